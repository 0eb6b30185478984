"""The builder CLI end to end on a tiny corpus with the serving model's tokenizer."""

import json

import numpy as np
import pytest

from ragcore.model_files import default_model_dir, is_model_dir, load_tokenizer, tokenizer_identity
from retrieval_service.datastore import build
from retrieval_service.datastore.suffix_array import SuffixArrayDatastore, TokenizerMismatch, check_datastore

pytestmark = [
    pytest.mark.model,
    pytest.mark.skipif(not is_model_dir(default_model_dir()), reason="default model not prepared (make model)"),
]


def test_build_cli_files_and_jsonl(tmp_path, capsys):
    src = tmp_path / "src"
    (src / "pkg").mkdir(parents=True)
    (src / "a.py").write_text("def add(a, b):\n    return a + b\n")
    (src / "pkg" / "b.py").write_text("def mul(a, b):\n    return a * b\n")
    (src / "image.png").write_bytes(b"\x89PNG\0\0")  # not a text suffix: ignored
    lines = [json.dumps({"text": "hello world"}), "", json.dumps({"text": "x = 1"})]  # blank lines are skipped
    (tmp_path / "docs.jsonl").write_text("\n".join(lines) + "\n")
    out = tmp_path / "ds"
    argv = ["--input", str(src), "--jsonl", str(tmp_path / "docs.jsonl"), "--out", str(out), "--shard-tokens", "12",
            "--no-progress"]
    assert build.main(argv) == 0
    tokenizer = load_tokenizer(default_model_dir())
    ds = SuffixArrayDatastore.open(out, expected_tokenizer_id=tokenizer_identity(tokenizer))
    texts = [tokenizer.decode(s.document(i)) for s in ds.shards for i in range(s.num_documents)]
    assert texts == ["def add(a, b):\n    return a + b\n", "def mul(a, b):\n    return a * b\n", "hello world", "x = 1"]
    assert ds.num_shards >= 2 and ds.vocab_size == len(tokenizer) and ds.shards[0].tokens.dtype == np.uint16
    check_datastore(out)
    # Drafting with the real tokenizer: "return a" continues with " + b" or " * b".
    ctx = tokenizer.encode("    return a", add_special_tokens=False)
    assert {tokenizer.decode(p) for p in ds.draft(ctx, min_suffix=1).paths() if len(p) == 1} == {" +", " *"}
    assert build.main(argv) == 0 and "nothing to do" in capsys.readouterr().out
    with pytest.raises(TokenizerMismatch):
        SuffixArrayDatastore.open(out, expected_tokenizer_id="vocab1-other")


def test_a_finished_datastore_is_kept_only_when_asked_after_its_corpus_changed(tmp_path, capsys):
    """A reinstalled venv rewrites every site-packages mtime: `make bench-datastores` keeps what it built."""
    src = tmp_path / "a.py"
    src.write_text("def add(a, b):\n    return a + b\n")
    out = tmp_path / "ds"
    argv = ["--input", str(src), "--out", str(out), "--no-progress"]
    assert build.main(argv) == 0
    src.write_text("def sub(a, b):\n    return a - b\n")  # the corpus changed after the build
    capsys.readouterr()
    scenarios = [  # (extra flags, expected exit code, expected in the output, not expected)
        ([], 2, "another corpus", "kept"),
        (["--keep-finished"], 0, "kept as it is", "another corpus"),
    ]
    for extra, code, said, not_said in scenarios:
        assert build.main(argv + extra) == code
        text = "".join(capsys.readouterr())
        assert said in text and not_said not in text
    tokenizer = load_tokenizer(default_model_dir())
    ds = SuffixArrayDatastore.open(out, expected_tokenizer_id=tokenizer_identity(tokenizer))
    assert tokenizer.decode(ds.shards[0].document(0)) == "def add(a, b):\n    return a + b\n"  # not rebuilt


def test_build_cli_rejects_bad_arguments(tmp_path, capsys):
    with pytest.raises(SystemExit):
        build.main(["--out", str(tmp_path / "x")])  # no corpus
    assert "give a corpus" in capsys.readouterr().err
    assert build.main(["--input", str(tmp_path / "missing*.py"), "--out", str(tmp_path / "x"), "--no-progress"]) == 2
    assert "neither a directory" in capsys.readouterr().err
