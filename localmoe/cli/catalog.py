"""The registry and the hub from the command line: `models` (the registry's table), `show` (what a model needs,
from its config alone) and `pull` (a download into the Hugging Face cache). `models` imports no torch.
"""

from __future__ import annotations

import json

from localmoe.safe_text import for_line, for_terminal


def cmd_show(args) -> int:
    from localmoe.engine import plan

    result = plan.show(args.model, vram_gib=args.vram, experts_format=args.experts, context=args.context)
    if args.json:
        print(json.dumps(result.as_json()))
    else:
        print(for_terminal(result.text()))
    return 0


def cmd_models(args) -> int:
    from localmoe.models.hub import is_downloaded
    from localmoe.models.registry import load_registry

    reg = load_registry()
    specs = list(reg.models.values())
    if args.json:  # numbers as numbers, sparsity as a fraction, sizes in GB
        print(
            json.dumps(
                [
                    {
                        "alias": s.alias,
                        "repo": s.repo,
                        "family": s.family,
                        "params_b": s.params_b,
                        "bf16_gb": s.bf16_gb,
                        "default_sparsity": s.sparsity,
                        "vram": s.vram,
                        "default": s.alias == reg.default,
                        "downloaded": is_downloaded(s),
                        "supported": not s.unsupported,
                        "unsupported_reason": s.unsupported or None,
                    }
                    for s in specs
                ]
            )
        )
        return 0
    rows = [
        (
            s.alias + (" (default)" if s.alias == reg.default else ""),
            s.repo,
            f"{s.bf16_gb:g} GB",
            f"{s.sparsity:.1%}",
            "yes" if is_downloaded(s) else "no",
            "no" if s.unsupported else "yes",
        )
        for s in specs
    ]
    head = ("ALIAS", "REPO", "BF16 SIZE", "SPARSITY", "DOWNLOADED", "SUPPORTED")
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
    for r in (head, *rows):
        print(for_line("  ".join(str(x).ljust(w) for x, w in zip(r, widths)).rstrip()))
    for s in specs:
        if s.unsupported:
            print(for_line(f"{s.alias}: not supported: {s.unsupported}"))
    return 0


def cmd_pull(args) -> int:
    from localmoe.models import hub

    resolved = hub.resolve(args.model, download_missing=True, pulling=True)
    print(for_line(f"{resolved.name}: {resolved.path}"))
    return 0
