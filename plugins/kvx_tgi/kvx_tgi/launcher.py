"""`kvx-tgi-server`: TGI's `text-generation-server` with the KVX attention backend installed first.

    ATTENTION=flashdecoding PREFIX_CACHING=1 KVX_FORMAT=nvfp4 kvx-tgi-server serve MODEL --uds-path /tmp/tgi

Takes exactly TGI's server CLI (`serve`, `download-weights`, ...): it installs the backend (`kvx_tgi.install`,
format from `KVX_FORMAT`), then hands the arguments to TGI's own Typer app. TGI's Rust launcher starts the
server as `text-generation-server serve ...` from PATH; under it, a `text-generation-server` script that runs
`exec kvx-tgi-server "$@"` placed first on PATH does the swap (not run here: no Rust launcher on these
machines; the tests drive the gRPC service as the router does). Refusals (a bad or missing
`KVX_FORMAT`, `ATTENTION=flashinfer`, `--kv-cache-dtype`, `--speculate`, `--sharded`) exit with status 2 and
one line on stderr before anything loads.
"""
from __future__ import annotations

import sys

from kvx_core.errors import KvxError, Status

_REFUSED_FLAGS = {
    "--kv-cache-dtype": "TGI's FP8 cache dtype is replaced by KVX_FORMAT (fp8_e4m3 / fp8_e5m2 are KVX formats)",
    "--speculate": "speculative decoding is not supported by the KVX backend (not verified)",
    "--sharded": "tensor-parallel (sharded) serving with the KVX backend is not verified",
}


def _refused(argv: list[str]) -> str | None:
    for i, arg in enumerate(argv):
        flag = arg.split("=", 1)[0]
        if flag in _REFUSED_FLAGS:
            value = arg.split("=", 1)[1] if "=" in arg else (argv[i + 1] if i + 1 < len(argv) else "")
            if flag == "--speculate" and value == "0":
                continue
            return f"{flag}: {_REFUSED_FLAGS[flag]}"
    return None


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    reason = _refused(argv) if argv[:1] == ["serve"] else None
    try:
        if reason is not None:
            raise KvxError(Status.UNSUPPORTED, reason)
        if argv[:1] == ["serve"]:
            import kvx_tgi

            kvx_tgi.install()
    except KvxError as e:
        print(f"kvx-tgi-server: error: {e.message}", file=sys.stderr)
        return 2
    from text_generation_server.cli import app

    app(args=argv, prog_name="kvx-tgi-server")
    return 0


if __name__ == "__main__":
    sys.exit(main())
