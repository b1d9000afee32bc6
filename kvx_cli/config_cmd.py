"""`kvx config`: every KVX setting's effective value here and where it comes from (`kvx_core.config`).

The environment is this shell's; `--additional-config` takes what a vLLM run would get, to see its effective
values. A bad value (in either) is refused as the engine would refuse it: one line, exit status 2. `--markdown`
prints docs/guide/configuration.md.
"""
from __future__ import annotations

import argparse
import json

from kvx_core import config, jsonsafe


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("config", help="print each KVX setting's effective value and its source",
                       description="Print every KVX setting (kvx_core/config.py) with its effective value and its "
                                   "source: default, env KVX_<NAME>, or a vLLM --additional-config key.")
    p.add_argument("--additional-config", metavar="JSON", default=None,
                   help="""vLLM's --additional-config, e.g. '{"kvx": {"rotate": true}}'""")
    out = p.add_mutually_exclusive_group()
    out.add_argument("--json", action="store_true", help="print one JSON object {name: {value, source}}")
    out.add_argument("--markdown", action="store_true", help="print the settings table (docs/guide/configuration.md)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if args.markdown:
        print(config.render_markdown(), end="")
        return 0
    additional = None if args.additional_config is None else jsonsafe.loads(args.additional_config,
                                                                           "--additional-config")
    values = config.effective(config.vllm_given(additional, {}))
    if args.json:
        print(json.dumps({name: {"value": r.value, "source": r.source} for name, r in values.items()}, indent=1))
        return 0
    width = max(map(len, values))
    for name, r in values.items():
        shown = "unset" if r.value is None else repr(r.value)
        print(f"{name:<{width}}  {shown:<24}  {r.source}")
    return 0
