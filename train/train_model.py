"""Train and export ``localmoe-tiny``, a ~11.6M-parameter Qwen3-MoE language model.

Input (from ``train/train_tokenizer.py``), in ``--data``:
``train.bin`` (uint16 token stream), ``heldout.bin`` (uint16, held-out text),
``tokenizer/`` (tokenizer.json, tokenizer_config.json).

``val.bin`` (validation pages, disjoint from the training pages; if absent, the last
``--val-frac`` of ``train.bin``) is never trained on and serves for checkpoint selection; ``heldout.bin``
(``localmoe/data/heldout.txt``) is only reported.
Training: random 512-token windows, AdamW (0.9, 0.95), wd 0.1, linear warm-up then cosine
decay to 10 %, bf16 autocast, load-balancing aux loss (``router_aux_loss_coef``).
With ``--steps 0`` the step count is derived from ``--time-budget`` after timing the first
steps (the chosen count is printed; pass it back with ``--steps`` to reproduce exactly).

Export (``--out``): ``save_pretrained`` in bf16 safetensors + tokenizer files +
``generation_config.json``; prints held-out perplexity and greedy chat samples.

``--arch deamoe`` trains the DeaMoE twin (``localmoe.models.deamoe``, same attention, embeddings and data):
departments of experts sharing gate/up/down projections, a private [h, h] per expert (identity init), top-k experts
within the best ``--topk-group`` departments. The default shape (6 departments x 5 experts, width 120, top-4 in
2 departments) matches localmoe-tiny's parameters and per-token expert FLOPs within 1 % (``shape_report`` prints
both; the typical token touches 2 departments: 2 x 3 x 120 x 256 shared + 4 x 120^2 private MACs per layer).

Usage::

    python train/train_model.py --data .work/tiny/carry --out .work/tiny/out --steps 4000
    python train/train_model.py --data .work/tiny/carry --out /tmp/dbg --debug   # CPU smoke test
    python train/train_model.py --arch deamoe --data .work/tiny/carry --out /tmp/dbg --debug
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from transformers import GenerationConfig, Qwen3MoeConfig, Qwen3MoeForCausalLM

SEED = 1234
EOT, IM_START, IM_END = 0, 1, 2
REPO = Path(__file__).resolve().parent.parent


def make_deamoe_config(args, debug: bool = False):
    """The DeaMoE twin of `make_config`: same attention, vocabulary, embeddings; DeaMoE layers of the given shape."""
    sys.path.insert(0, str(REPO))
    from localmoe.models.deamoe import DeaMoeConfig

    base = make_config(debug).to_dict()
    keep = (
        "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
        "hidden_act", "max_position_embeddings", "initializer_range", "rms_norm_eps", "use_cache",
        "tie_word_embeddings", "rope_parameters", "attention_bias", "attention_dropout", "norm_topk_prob",
        "router_aux_loss_coef", "pad_token_id", "bos_token_id", "eos_token_id",
    )  # fmt: skip
    return DeaMoeConfig(
        **{k: base[k] for k in keep},
        num_departments=3 if debug else args.departments,
        experts_per_department=2 if debug else args.experts_per_department,
        department_size=32 if debug else args.department_size,
        num_experts_per_tok=2 if debug else args.top_k,
        topk_group=2 if debug else args.topk_group,
        department_score=args.department_score,
        private_init="identity",
    )


def shape_report(cfg) -> dict:
    """Parameters and per-token multiply-accumulates of one MoE layer's router + routed experts (the typical token:
    vanilla k experts; DeaMoE min(k, topk_group) departments' shared projections + k private matrices)."""
    H = cfg.hidden_size
    if cfg.model_type == "deamoe":
        D, n, h, k = cfg.num_departments, cfg.experts_per_department, cfg.department_size, cfg.num_experts_per_tok
        g = min(k, cfg.topk_group, D)
        params = D * 3 * h * H + D * n * h * h + D * n * H
        macs = g * 3 * h * H + k * h * h + D * n * H
    else:
        E, I, k = cfg.num_experts, cfg.moe_intermediate_size, cfg.num_experts_per_tok
        params = E * 3 * I * H + E * H
        macs = k * 3 * I * H + E * H
    return {"moe_layer_params": params, "moe_layer_macs_per_token": macs}


def make_config(debug: bool = False) -> Qwen3MoeConfig:
    return Qwen3MoeConfig(
        vocab_size=8192,
        hidden_size=256 if not debug else 64,
        intermediate_size=768 if not debug else 128,  # unused: every layer is sparse
        num_hidden_layers=8 if not debug else 2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64 if not debug else 16,
        hidden_act="silu",
        max_position_embeddings=1024,
        initializer_range=0.02,
        rms_norm_eps=1e-6,
        use_cache=True,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        attention_bias=False,
        attention_dropout=0.0,
        decoder_sparse_step=1,
        moe_intermediate_size=160 if not debug else 32,
        num_experts_per_tok=2,
        num_experts=8,
        norm_topk_prob=True,
        output_router_logits=False,
        router_aux_loss_coef=0.01,
        mlp_only_layers=[],
        pad_token_id=EOT,
        bos_token_id=None,
        eos_token_id=IM_END,
    )


def load_balancing_loss(router_logits: tuple[torch.Tensor, ...], num_experts: int, top_k: int) -> torch.Tensor:
    """Switch-style aux loss: num_experts * sum_e(fraction_routed_e * mean_prob_e), averaged over layers."""
    total = 0.0
    for logits in router_logits:
        probs = torch.softmax(logits.float(), dim=-1)
        _, sel = torch.topk(probs, top_k, dim=-1)
        frac = F.one_hot(sel, num_experts).float().sum(1).mean(0) / top_k
        total = total + num_experts * (frac * probs.mean(0)).sum()
    return total / len(router_logits)


def collect_router_logits(model):
    """Forward hooks on each router; returns the list they fill."""
    store: list[torch.Tensor] = []
    for layer in model.model.layers:
        layer.mlp.gate.register_forward_hook(lambda m, i, o: store.append(o[0]))
    return store


@torch.no_grad()
def evaluate(model, tokens: torch.Tensor, seq: int, device, batch: int = 32, max_windows: int = 10**9) -> float:
    """Mean next-token NLL over non-overlapping windows of ``seq`` tokens (no carried context)."""
    model.eval()
    n = min((tokens.numel() - 1) // seq, max_windows)
    total, count = 0.0, 0
    for i in range(0, n, batch):
        idx = torch.arange(i, min(i + batch, n))
        x = torch.stack([tokens[j * seq : (j + 1) * seq + 1] for j in idx.tolist()]).to(device).long()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            logits = model(input_ids=x[:, :-1]).logits
        loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), x[:, 1:].reshape(-1), reduction="sum")
        total += loss.item()
        count += x[:, 1:].numel()
    # tail (partial window)
    rest = tokens[n * seq :]
    if n < max_windows and rest.numel() > 1:
        x = rest.to(device).long()[None]
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            logits = model(input_ids=x[:, :-1]).logits
        total += F.cross_entropy(logits.float()[0], x[0, 1:], reduction="sum").item()
        count += x.size(1) - 1
    model.train()
    return total / count


def chat_samples(model, tok_dir: Path, device, prompts: list[str], max_new_tokens: int = 80) -> list[str]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    model.eval()
    outs = []
    for p in prompts:
        ids = tok.apply_chat_template(
            [{"role": "user", "content": p}], add_generation_prompt=True, return_tensors="pt", return_dict=True
        )["input_ids"].to(device)
        with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            gen = model.generate(
                ids,
                max_new_tokens=max_new_tokens,
                do_sample=False,
                eos_token_id=[IM_END, EOT],
                pad_token_id=EOT,
                repetition_penalty=1.1,
            )
        outs.append(tok.decode(gen[0, ids.shape[1] :], skip_special_tokens=True))
    model.train()
    return outs


def build_model(cfg, impl: str, device):
    torch.manual_seed(SEED)
    if cfg.model_type == "deamoe":
        from localmoe.models.deamoe import DeaMoeForCausalLM

        return DeaMoeForCausalLM(cfg).to(device)
    cfg._experts_implementation = impl
    model = Qwen3MoeForCausalLM(cfg).to(device)
    return model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=0, help="0 = derive from --time-budget")
    ap.add_argument("--time-budget", type=float, default=330.0, help="seconds of training when --steps 0")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--min-lr-ratio", type=float, default=0.1)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--wd", type=float, default=0.1)
    ap.add_argument("--val-frac", type=float, default=0.01)
    ap.add_argument("--eval-every", type=int, default=400)
    ap.add_argument("--experts-impl", default="auto", help="auto | grouped_mm | batched_mm | eager")
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--shard-size", default=None, help="save_pretrained max_shard_size, e.g. 12MB")
    ap.add_argument("--minimal-out", action="store_true", help="write only the checkpoint (no tokenizer, no samples)")
    ap.add_argument("--debug", action="store_true", help="tiny model, few steps (CPU smoke test)")
    ap.add_argument("--arch", choices=("qwen3_moe", "deamoe"), default="qwen3_moe")
    ap.add_argument("--departments", type=int, default=6, help="deamoe: departments per layer")
    ap.add_argument("--experts-per-department", type=int, default=5, help="deamoe: experts per department")
    ap.add_argument("--department-size", type=int, default=120, help="deamoe: department width h")
    ap.add_argument("--top-k", type=int, default=4, help="deamoe: experts per token")
    ap.add_argument("--topk-group", type=int, default=2, help="deamoe: departments a token may use")
    ap.add_argument("--department-score", choices=("max", "top2_sum"), default="max", help="deamoe: department rank")
    args = ap.parse_args()

    torch.manual_seed(SEED)
    np.random.seed(SEED)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    data = Path(args.data)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    all_tok = torch.from_numpy(np.fromfile(data / "train.bin", dtype=np.uint16).astype(np.int32))
    if (data / "val.bin").exists():  # validation pages, disjoint from training pages
        train_tok = all_tok
        val_tok = torch.from_numpy(np.fromfile(data / "val.bin", dtype=np.uint16).astype(np.int32))
    else:  # fall back to a slice of the training stream
        n_val = int(all_tok.numel() * args.val_frac)
        train_tok, val_tok = all_tok[:-n_val], all_tok[-n_val:]
    held_tok = torch.from_numpy(np.fromfile(data / "heldout.bin", dtype=np.uint16).astype(np.int32))
    print(f"tokens: train {train_tok.numel():,} val {val_tok.numel():,} heldout {held_tok.numel():,}", flush=True)
    train_gpu = train_tok.to(device)

    cfg = make_deamoe_config(args, args.debug) if args.arch == "deamoe" else make_config(args.debug)
    print(f"arch {cfg.model_type}: {shape_report(cfg)}", flush=True)
    B, T = (4, 64) if args.debug else (args.batch, args.seq)
    gen = torch.Generator(device="cpu").manual_seed(SEED)

    def batch():
        starts = torch.randint(0, train_gpu.numel() - T - 1, (B,), generator=gen).to(device)
        idx = starts[:, None] + torch.arange(T + 1, device=device)[None]
        x = train_gpu[idx].long()
        return x[:, :-1], x[:, 1:]

    # ---- pick the experts implementation by timing a few steps of each
    impls = (
        ["departments"]  # deamoe: localmoe's DepartmentExperts, no choice
        if args.arch == "deamoe"
        else [args.experts_impl]
        if args.experts_impl != "auto"
        else (["grouped_mm", "batched_mm", "eager"] if device.type == "cuda" else ["eager"])
    )
    best = None
    if len(impls) > 1:
        for impl in impls:
            try:
                m = build_model(cfg, impl, device)
                opt = torch.optim.AdamW(m.parameters(), lr=1e-4)
                for i in range(8):
                    if i == 3:
                        torch.cuda.synchronize()
                        t0 = time.time()
                    x, y = batch()
                    with torch.autocast("cuda", dtype=torch.bfloat16):
                        loss = F.cross_entropy(m(input_ids=x).logits.float().view(-1, cfg.vocab_size), y.reshape(-1))
                    loss.backward()
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                torch.cuda.synchronize()
                dt = (time.time() - t0) / 5
                print(f"experts_implementation={impl}: {dt * 1000:.1f} ms/step loss {loss.item():.3f}", flush=True)
                if best is None or dt < best[1]:
                    best = (impl, dt)
                del m, opt
            except Exception as e:  # noqa: BLE001 - any failure just disqualifies the implementation
                print(f"experts_implementation={impl}: failed ({type(e).__name__}: {str(e)[:200]})", flush=True)
        impl = best[0] if best else "eager"
        gen.manual_seed(SEED)
    else:
        impl = impls[0]
    print(f"using experts_implementation={impl}", flush=True)

    model = build_model(cfg, impl, device)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"params: {n_params:,}", flush=True)
    router_logits = collect_router_logits(model)
    step_model = torch.compile(model) if args.compile else model

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "norm" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "norm" not in n)]
    fused = device.type == "cuda"
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.wd}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
        fused=fused,
    )

    total_steps = args.steps if args.steps > 0 else None
    warmup = 5 if args.debug else args.warmup

    def lr_at(step: int) -> float:
        if step < warmup:
            return args.lr * (step + 1) / warmup
        if total_steps is None:  # only while timing the first steps with a very short warm-up
            return args.lr
        prog = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        return args.lr * (args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * prog)))

    best_val, best_state, best_step = float("inf"), None, -1
    t_start = time.time()
    t_probe = None
    step = 0
    log = []
    while total_steps is None or step < total_steps:
        if total_steps is None and step == 10:
            if device.type == "cuda":
                torch.cuda.synchronize()
            t_probe = time.time()
        if total_steps is None and step == 40:
            if device.type == "cuda":
                torch.cuda.synchronize()
            per = (time.time() - t_probe) / 30
            # leave ~8% for evaluations
            total_steps = int((args.time_budget - (time.time() - t_start)) / (per * 1.08)) + step
            print(f"{per * 1000:.1f} ms/step -> total_steps={total_steps}", flush=True)
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        x, y = batch()
        router_logits.clear()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            logits = step_model(input_ids=x).logits
        ce = F.cross_entropy(logits.float().view(-1, cfg.vocab_size), y.reshape(-1))
        aux = load_balancing_loss(router_logits, cfg.num_experts, cfg.num_experts_per_tok)
        loss = ce + cfg.router_aux_loss_coef * aux
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        if step % 100 == 0 or step == 1 or (args.debug and step % 5 == 0):
            print(
                f"step {step}/{total_steps} ce {ce.item():.4f} aux {aux.item():.3f} gnorm {gnorm.item():.2f} "
                f"lr {lr_at(step - 1):.2e} t {time.time() - t_start:.0f}s",
                flush=True,
            )
        last = total_steps is not None and step >= total_steps
        if step % args.eval_every == 0 or last:
            vl = evaluate(model, val_tok, T, device, max_windows=64 if args.debug else 10**9)
            hl = evaluate(model, held_tok, T, device, max_windows=16 if args.debug else 10**9)
            log.append({"step": step, "val_loss": vl, "heldout_loss": hl, "time_s": time.time() - t_start})
            router_logits.clear()
            print(
                f"eval step {step}: val {vl:.4f} (ppl {math.exp(vl):.2f}) heldout {hl:.4f} (ppl {math.exp(hl):.2f})",
                flush=True,
            )
            if vl < best_val:
                best_val, best_step = vl, step
                best_state = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
    train_time = time.time() - t_start
    print(f"trained {step} steps in {train_time:.0f}s; best val at step {best_step}", flush=True)
    model.load_state_dict(best_state)

    # ---- export
    held_loss = evaluate(model, held_tok, T, device)
    model_bf16 = model.to(torch.bfloat16)
    model_bf16.generation_config = GenerationConfig(
        bos_token_id=None,
        eos_token_id=[IM_END, EOT],
        pad_token_id=EOT,
        do_sample=True,
        temperature=0.7,
        top_p=0.9,
        top_k=40,
        repetition_penalty=1.1,
        max_new_tokens=256,
    )
    save_kw = {"max_shard_size": args.shard_size} if args.shard_size else {}
    model_bf16.save_pretrained(out, safe_serialization=True, **save_kw)
    if not args.minimal_out:
        for f in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(data / "tokenizer" / f, out / f)
    summary = {
        "params": n_params,
        "steps": step,
        "batch": B,
        "seq": T,
        "train_time_s": round(train_time, 1),
        "tokens_seen": step * B * T,
        "experts_implementation": impl,
        "arch": cfg.model_type,
        **shape_report(cfg),
        "best_step": best_step,
        "val_loss": best_val,
        "heldout_loss": held_loss,
        "heldout_ppl": math.exp(held_loss),
        "heldout_tokens": int(held_tok.numel()),
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "evals": log,
        "args": vars(args),
    }
    (out / "train_summary.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps({k: v for k, v in summary.items() if k != "evals"}, indent=2), flush=True)

    if args.minimal_out:
        return
    model = model.float()
    prompts = [
        "What is a list comprehension?",
        "Explain the os module.",
        "What does os.path.join() do?",
        "Hello",
        "How do I create a table in PostgreSQL?",
        "What is a decorator?",
    ]
    try:
        for p, r in zip(prompts, chat_samples(model, data / "tokenizer", device, prompts)):
            print(f"\n>>> {p}\n{r}", flush=True)
    except Exception as e:  # noqa: BLE001 - samples are informative only; the export is already written
        print(f"sampling failed: {type(e).__name__}: {e}", flush=True)


if __name__ == "__main__":
    main()
