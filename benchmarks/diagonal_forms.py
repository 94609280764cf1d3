"""How often the Triton stage 1 would walk a diagonal sub-block, on a model's real log decays.

    python -m benchmarks profile diagonal --preset 340M --mixers gdn2 muir kdn_diag   # at init
    python -m benchmarks profile diagonal --checkpoint runs/my_run/model              # trained

A diagonal sub-block (16 tokens, one sequence and head) takes the factored form, two matrix
products, when every |cumulative log decay| inside it is below `DIAGONAL_FACTOR_BOUND`, over all
channels; otherwise the serial row walk (`deltalab/ops/delta_rule/triton/intra.py`). This runs
the model on CPU over random token ids, reads each delta layer's log decays `g` through its gate
hook, and prints per layer the fraction of sub-blocks that would be walked and the largest
depth max|c|. It times nothing (docs/PERFORMANCE.md, "Deep decays", has the timings).
"""

from __future__ import annotations

import argparse

import torch

from deltalab.layers.delta_mixer import DeltaMixer
from deltalab.ops.delta_rule.triton.intra import DIAGONAL_FACTOR_BOUND, SUB_BLOCK


def sub_block_depths(g: torch.Tensor) -> torch.Tensor:
    """max over channels of |sum of g| per full 16-token sub-block: [B, n, H] of g [B, T, H(, K)].
    g <= 0, so the cumulative sum is deepest at the sub-block's end."""
    g = g.float() if g.dim() == 4 else g.float()[..., None]
    full = g.shape[1] // SUB_BLOCK * SUB_BLOCK
    return g[:, :full].unflatten(1, (-1, SUB_BLOCK)).sum(2).abs().amax(-1)


def layer_depths(model: torch.nn.Module, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per delta layer, the depths of its full diagonal sub-blocks on `ids` (one forward)."""
    found: dict[str, torch.Tensor] = {}
    handles = []
    for name, layer in model.named_modules():
        if not isinstance(layer, DeltaMixer):
            continue

        def record(gates: dict[str, torch.Tensor], name: str = name) -> dict[str, torch.Tensor]:
            if "g" in gates:
                found[name] = sub_block_depths(gates["g"].detach())
            return gates

        handles.append(layer.register_gate_hook(record))
    try:
        with torch.no_grad():
            model(ids)
    finally:
        for handle in handles:
            handle.remove()
    return found


def walked(depths: dict[str, torch.Tensor], bound: float) -> dict[str, tuple[float, float]]:
    """Per layer: (fraction of sub-blocks walked at `bound`, largest depth)."""
    return {
        name: ((depth >= bound).float().mean().item(), depth.max().item())
        for name, depth in depths.items()
    }


def measure(
    model: torch.nn.Module, ids: torch.Tensor, bound: float = DIAGONAL_FACTOR_BOUND
) -> dict[str, tuple[float, float]]:
    """Per delta layer: (fraction of sub-blocks walked at `bound`, largest depth)."""
    return walked(layer_depths(model, ids), bound)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", default="340M")
    parser.add_argument("--mixers", nargs="+", default=["gdn2", "muir", "kdn_diag"])
    parser.add_argument("--checkpoint", nargs="+", default=None, help="saved model directories")
    parser.add_argument("--num-layers", type=int, default=4, help="of a preset (init only)")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--bound", type=float, nargs="+", default=[DIAGONAL_FACTOR_BOUND],
        help="factored-form bounds to count against (default: stage 1's)",
    )  # fmt: skip


def run(args: argparse.Namespace) -> dict:
    from deltalab.models import CausalLM, build_config

    torch.manual_seed(args.seed)
    models = []
    if args.checkpoint:
        models = [
            (path, lambda path=path: CausalLM.from_pretrained(path)) for path in args.checkpoint
        ]
    else:
        models = [
            (
                f"{args.preset} {mixer} (init, {args.num_layers} layers)",
                lambda mixer=mixer: CausalLM(
                    build_config(args.preset, mixer=mixer, num_layers=args.num_layers)
                ),
            )
            for mixer in args.mixers
        ]
    print(f"sub-blocks of {SUB_BLOCK} tokens, {args.batch} x {args.seq_len} random token ids")
    report: dict = {"sub_block": SUB_BLOCK, "models": {}}
    for label, build in models:
        model = build().eval()
        ids = torch.randint(0, model.config.vocab_size, (args.batch, args.seq_len))
        print(label)
        depths = layer_depths(model, ids)
        entry = report["models"][label] = {"walked": {}}
        for bound in args.bound:
            found = walked(depths, bound)
            entry["walked"][str(bound)] = [w for w, _ in found.values()]
            fractions = " ".join(f"{w:.2f}" for w, _ in found.values())
            print(f"  walked fraction per layer at bound {bound:g}: {fractions}")
        entry["largest_depth"] = [d for _, d in found.values()]
        depth = " ".join(f"{d:.0f}" for _, d in found.values())
        print(f"  largest depth per layer: {depth}")
    return report
