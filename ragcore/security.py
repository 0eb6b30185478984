"""Transport security and request hygiene shared by both services.

- Bearer token: with `auth_token` (or `auth_token_file`, e.g. a docker secret) set, every RPC must carry the
  metadata `authorization: Bearer <token>`, else UNAUTHENTICATED. grpc.health.v1 is exempt so probes work.
- TLS: `tls_cert` + `tls_key` (PEM) serve TLS; `tls_client_ca` additionally requires client certificates
  signed by that CA (mutual TLS). Off by default (loopback); on in the docker-compose example.
- Undecodable requests: a proto3 `string` holding invalid UTF-8 (or any bytes that are not the message) fails
  inside gRPC's deserializer, which answers INTERNAL "Exception deserializing request!". DecodeErrorInterceptor
  turns that into INVALID_ARGUMENT naming the field, e.g. "stop[0]: invalid UTF-8 in a string field".

    python -m ragcore.security make-certs --out DIR --hosts retrieval,generation,localhost [--ca-key-dir KEYDIR]

writes a throwaway CA and a server certificate for those names with the openssl CLI (the compose init step).
"""

from __future__ import annotations

import argparse
import hmac
import os
import subprocess
from pathlib import Path
from typing import Any

import grpc
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import DecodeError

HEALTH_PREFIX = "/grpc.health.v1.Health/"


def read_token(token: str = "", token_file: str = "") -> str:
    """The configured bearer token: the file's content (stripped) wins over the literal; "" = auth off."""
    if token_file:
        value = Path(token_file).read_text().strip()
        if not value:
            raise ValueError(f"auth_token_file: {token_file} is empty")
        return value
    return token.strip()


def auth_metadata(token: str) -> tuple[tuple[str, str], ...]:
    """Call metadata carrying the token (empty when auth is off)."""
    return (("authorization", f"Bearer {token}"),) if token else ()


# --------------------------------------------------------------------------------------------- bearer token

def _reject(kind_streaming: bool, code: grpc.StatusCode, message: str) -> grpc.RpcMethodHandler:
    def unary(request, context):
        context.abort(code, message)

    def stream(request, context):
        context.abort(code, message)
        yield  # pragma: no cover (makes this a generator)

    if kind_streaming:
        return grpc.unary_stream_rpc_method_handler(stream)
    return grpc.unary_unary_rpc_method_handler(unary)


class BearerTokenInterceptor(grpc.ServerInterceptor):
    """Refuse calls without `authorization: Bearer <token>` (constant-time compare); health is exempt."""

    def __init__(self, token: str):
        if not token:
            raise ValueError("BearerTokenInterceptor needs a non-empty token")
        self._want = f"Bearer {token}".encode()

    def intercept_service(self, continuation, handler_call_details):
        if handler_call_details.method.startswith(HEALTH_PREFIX):
            return continuation(handler_call_details)
        got = ""
        for key, value in handler_call_details.invocation_metadata or ():
            if key == "authorization":
                got = value if isinstance(value, str) else value.decode("latin-1")
                break
        if got and hmac.compare_digest(got.encode("utf-8", "replace"), self._want):
            return continuation(handler_call_details)
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        why = "missing authorization metadata" if not got else "invalid bearer token"
        # The payload is never parsed for an unauthenticated caller (no deserializer).
        return _reject(handler.response_streaming, grpc.StatusCode.UNAUTHENTICATED,
                       f"authorization: {why} (send 'authorization: Bearer <token>')")


# ---------------------------------------------------------------------------------------------------- TLS

def _read(path: str, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise ValueError(f"{what}: cannot read {path}: {e.strerror or e}") from None


def server_credentials(cert: str = "", key: str = "", client_ca: str = "") -> grpc.ServerCredentials | None:
    """TLS credentials from PEM paths; None when cert and key are both empty (plaintext)."""
    if not cert and not key:
        if client_ca:
            raise ValueError("tls_client_ca: client certificates need TLS (set tls_cert and tls_key)")
        return None
    if not (cert and key):
        raise ValueError("tls_cert/tls_key: give both the certificate and its private key")
    pair = [(_read(key, "tls_key"), _read(cert, "tls_cert"))]
    if client_ca:
        return grpc.ssl_server_credentials(pair, root_certificates=_read(client_ca, "tls_client_ca"),
                                           require_client_auth=True)
    return grpc.ssl_server_credentials(pair)


def channel_credentials(ca: str = "", cert: str = "", key: str = "") -> grpc.ChannelCredentials | None:
    """Client TLS: trust `ca` (PEM; system roots if ""), present cert/key for mutual TLS. None = plaintext."""
    if not (ca or cert or key):
        return None
    if bool(cert) != bool(key):
        raise ValueError("client tls cert/key: give both the certificate and its private key")
    return grpc.ssl_channel_credentials(root_certificates=_read(ca, "tls ca") if ca else None,
                                        private_key=_read(key, "tls key") if key else None,
                                        certificate_chain=_read(cert, "tls cert") if cert else None)


def server_setup(cfg: Any) -> tuple[list[grpc.ServerInterceptor], grpc.ServerCredentials | None]:
    """(auth interceptors, TLS credentials) from a service config with auth_token[_file], tls_* fields."""
    token = read_token(getattr(cfg, "auth_token", ""), getattr(cfg, "auth_token_file", ""))
    interceptors = [BearerTokenInterceptor(token)] if token else []
    creds = server_credentials(getattr(cfg, "tls_cert", ""), getattr(cfg, "tls_key", ""),
                               getattr(cfg, "tls_client_ca", ""))
    return interceptors, creds


# ------------------------------------------------------------------------------------ undecodable requests

class DecodeFailure:
    """Stands in for a request that did not parse; the wrapped handler answers INVALID_ARGUMENT."""

    def __init__(self, message: str):
        self.message = message


def _varint(data: bytes, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if i >= len(data) or shift > 63:
            raise IndexError
        b = data[i]
        value |= (b & 0x7F) << shift
        i += 1
        if not b & 0x80:
            return value, i
        shift += 7


def find_bad_field(descriptor: Descriptor, data: bytes, prefix: str = "") -> str | None:
    """Walk the wire format; return "path: invalid UTF-8 in a string field" for the first string field holding
    invalid UTF-8, None if there is none (or the bytes are not protobuf at all: the caller says so).

    E.g. a GenerateRequest whose second stop string is b"\\xff" -> "stop[1]: invalid UTF-8 in a string field".
    """
    counts: dict[int, int] = {}
    i = 0
    try:
        while i < len(data):
            key, i = _varint(data, i)
            number, wire = key >> 3, key & 7
            field = descriptor.fields_by_number.get(number)
            if wire == 0:
                _, i = _varint(data, i)
            elif wire == 1:
                i += 8
            elif wire == 5:
                i += 4
            elif wire == 2:
                n, i = _varint(data, i)
                chunk = data[i:i + n]
                i += n
                if len(chunk) != n:
                    return None
                if field is None:
                    continue
                index = counts.get(number, 0)
                counts[number] = index + 1
                path = prefix + field.name + (f"[{index}]" if field.is_repeated else "")
                if field.type == FieldDescriptor.TYPE_STRING:
                    try:
                        chunk.decode("utf-8")
                    except UnicodeDecodeError:
                        return f"{path}: invalid UTF-8 in a string field"
                elif field.type == FieldDescriptor.TYPE_MESSAGE:
                    found = find_bad_field(field.message_type, chunk, path + ".")
                    if found:
                        return found
            else:
                return None
    except IndexError:
        return None
    return None


def _safe(deserializer, type_name: str, descriptor: Descriptor | None):
    def parse(data: bytes):
        try:
            return deserializer(data)
        except (DecodeError, UnicodeDecodeError, ValueError, RuntimeError) as e:
            try:
                where = find_bad_field(descriptor, data) if descriptor is not None else None
            except Exception:  # the diagnosis is best effort; the answer stays INVALID_ARGUMENT
                where = None
            return DecodeFailure(where or f"request: not a valid {type_name} message ({e})")

    return parse


class DecodeErrorInterceptor(grpc.ServerInterceptor):
    """Map request decoding errors to INVALID_ARGUMENT naming the field instead of gRPC's INTERNAL."""

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or handler.request_streaming or handler.request_deserializer is None:
            return handler
        if handler.response_streaming and handler_call_details.method.startswith(HEALTH_PREFIX):
            return handler  # a Watch answered without a handler thread (grpc_shell._health_watch): keep it so
        deser = handler.request_deserializer
        owner = getattr(deser, "__self__", None)  # Message.FromString is a classmethod bound to the type
        descriptor = getattr(owner, "DESCRIPTOR", None)
        type_name = descriptor.full_name if descriptor is not None else "request"
        parse = _safe(deser, type_name, descriptor)

        if handler.response_streaming:
            inner_stream = handler.unary_stream

            def stream(request, context):
                if isinstance(request, DecodeFailure):
                    context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
                yield from inner_stream(request, context)

            return grpc.unary_stream_rpc_method_handler(stream, request_deserializer=parse,
                                                        response_serializer=handler.response_serializer)
        inner = handler.unary_unary

        def unary(request, context):
            if isinstance(request, DecodeFailure):
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
            return inner(request, context)

        return grpc.unary_unary_rpc_method_handler(unary, request_deserializer=parse,
                                                   response_serializer=handler.response_serializer)


# ------------------------------------------------------------------------------------------ make-certs CLI

def make_certs(out: str | os.PathLike, hosts: list[str], days: int = 365,
               ca_key_dir: str | os.PathLike | None = None) -> dict[str, Path]:
    """A throwaway CA plus a server (and client) certificate for `hosts`, signed by it (openssl CLI).

    The CA's private key goes to `ca_key_dir` (default: `out`). Keep it out of a directory that servers mount: whoever
    reads it can issue certificates every client trusts (docker-compose.yml gives it a volume only `init` mounts).
    Idempotent: existing files are kept. Returns {"ca", "ca_key", "cert", "key", "client_cert", "client_key"}.
    """
    d = Path(out)
    d.mkdir(parents=True, exist_ok=True)
    key_dir = Path(ca_key_dir) if ca_key_dir else d
    key_dir.mkdir(parents=True, exist_ok=True)
    files = {"ca": d / "ca.pem", "ca_key": key_dir / "ca.key", "cert": d / "server.pem", "key": d / "server.key",
             "client_cert": d / "client.pem", "client_key": d / "client.key"}
    if all(p.exists() for p in files.values()):
        return files

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", str(days), "-subj", "/CN=ragserve-ca",
        "-keyout", str(files["ca_key"]), "-out", str(files["ca"]))
    san = ",".join(f"IP:{h}" if h.replace(".", "").isdigit() else f"DNS:{h}" for h in hosts)
    for who, cn in (("", hosts[0]), ("client_", "ragserve-client")):
        csr = d / f"{who}req.csr"
        ext = d / f"{who}ext.cnf"
        ext.write_text(f"subjectAltName={san}\n" if not who else "extendedKeyUsage=clientAuth\n")
        run("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={cn}", "-keyout", str(files[who + "key"]),
            "-out", str(csr))
        run("x509", "-req", "-in", str(csr), "-CA", str(files["ca"]), "-CAkey", str(files["ca_key"]),
            "-CAcreateserial", "-days", str(days), "-extfile", str(ext), "-out", str(files[who + "cert"]))
        csr.unlink()
        ext.unlink()
    for name in ("key", "client_key", "ca_key"):
        files[name].chmod(0o640)
    return files


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m ragcore.security", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make-certs", help="write a CA + server/client certificates (if missing)")
    m.add_argument("--out", required=True,
                   help="directory for the certificates and keys (created; files already there are kept)")
    m.add_argument("--hosts", default="localhost,127.0.0.1", help="comma-separated DNS names / IPs for the SAN")
    m.add_argument("--days", type=int, default=365,
                   help="validity of the CA and the certificates, days (default %(default)s)")
    m.add_argument("--ca-key-dir", default="",
                   help="where the CA private key goes (default: --out); keep it out of what servers mount")
    args = ap.parse_args(argv)
    files = make_certs(args.out, [h.strip() for h in args.hosts.split(",") if h.strip()], args.days,
                       args.ca_key_dir or None)
    for name, path in files.items():
        print(f"{name:<12} {path}")


if __name__ == "__main__":
    main()
