#!/usr/bin/env python3
"""Pretraining and fine-tuning with INT8 trainable attention (SageBwd) against BF16, in
one command: the experiment of SageAttention3's SageBwd sections on our hardware.

Model: model.py, a decoder-only transformer (default 8 layers, width 1024, 8 heads of
d=128, context 2048 byte tokens: 101M parameters), bf16 autocast, AdamW, the same seed
(the same initial weights and the same batches) in every run. Corpora (corpus.py,
fetched by fetch_corpus.sh into .deps/corpus/): pretraining on the Python 3.11
documentation (10.0 M training bytes, 1.0 M held out), fine-tuning on the Perl 5.36
documentation (8.4 M, 0.4 M held out); one byte is one token.

Runs, in this order:
  pretrain  bf16_sdpa       torch SDPA (BF16)
  pretrain  qattn_sagebwd   qattn.scaled_dot_product_attention: SageBwd, dO·Vᵀ in 16-bit
  finetune  bf16_sdpa       from bf16_sdpa's pretrained weights, on the other corpus
  finetune  qattn_sagebwd   the same, with qattn
  pretrain  qattn_dov_int8  qattn with dO·Vᵀ in INT8 too (the paper's ablation); last, so
                            that the backward option it sets touches no other run
and, on request (--runs ... pretrain:bf16_sdpa_seed1), BF16 from another seed: the
run-to-run spread against which a qattn-minus-BF16 difference is read.
Every run of a phase takes the same number of steps (the same token budget): --steps,
or else as many as the phase's first run does in --budget-seconds, measured on its
steps 3-13 (the learning-rate warm-up, which does not depend on the total). The
schedule is linear warm-up, then cosine decay to 10% of the peak. qattn runs with the
fallback set to "raise": a call qattn would hand to SDPA stops that run with an error
recorded in its entry, so no qattn curve is secretly SDPA's.

Validation: fixed held-out windows every --eval-every steps. val_loss is evaluated with
torch SDPA in BF16 for every run (it compares the trained weights); qattn runs also
record val_loss_own (evaluated with the run's own attention, qattn's inference forward).
Losses are nats per byte.

Writes OUT/NAME.json after every run: {"env": {...}, "runs": [{"name", "phase",
"attention", "steps", "loss", "tokens_per_s", "val_steps", "val_loss", ...}]}; the
plot: examples/train/plot_training.py.

On the GPU machine (carry .deps; after python/build_on_device.sh):
  PYTHONPATH=python python3 examples/train/train.py --out $OUT --commit <hash>
  # default budgets: 3 x 100 s pretraining + 2 x 50 s fine-tuning, ~7 minutes in all
A CPU check of the code paths (qattn runs substituted by torch SDPA, and marked so):
  python3 examples/train/train.py --device cpu --substitute-sdpa --layers 2 --dim 64 \\
      --heads 2 --ctx 128 --batch 4 --steps 50 --finetune-steps 20 --out /tmp/t
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import corpus  # noqa: E402
from model import ModelConfig, Transformer, loss_fn  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "python"))

# qattn's backward options for each attention (qattn.set_backward_options keywords).
QATTN_BACKWARD = {"qattn_sagebwd": {}, "qattn_dov_int8": {"dov": "quantized"}}
PLAN = [("pretrain", "bf16_sdpa"), ("pretrain", "qattn_sagebwd"), ("finetune", "bf16_sdpa"),
        ("finetune", "qattn_sagebwd"), ("pretrain", "qattn_dov_int8")]
# Not run by default: BF16 again from another seed (other initial weights and batches),
# the run-to-run spread that a qattn-minus-BF16 difference is to be read against.
EXTRA = [("pretrain", "bf16_sdpa_seed1")]
SEED_OFFSET = {"bf16_sdpa_seed1": 1}
CALIBRATE = (3, 13)  # steps whose time sets the phase's step count
TIME_CAP = 3.0  # a run stops after this many times the budget (recorded as truncated)


# ---- attention -----------------------------------------------------------------------


class AttentionUnavailable(RuntimeError):
    pass


def attention_for(kind: str, args):
    """The attention function of a run, and a label saying what ran."""
    if kind.startswith("bf16_sdpa"):
        return F.scaled_dot_product_attention, "torch SDPA, bf16 (default backend)"
    if args.substitute_sdpa:
        return F.scaled_dot_product_attention, f"torch SDPA substituted for {kind} (--substitute-sdpa: a code check, not a result)"
    try:
        import qattn
    except ImportError as e:
        raise AttentionUnavailable(f"qattn does not import: {e} (PYTHONPATH=python, built?)") from e
    if not (qattn.built_with_cuda() and torch.cuda.is_available() and qattn.device_supported()):
        raise AttentionUnavailable("qattn's kernels do not run here (needs a CUDA build and an sm_90 GPU)")
    qattn.set_fallback("raise")
    options = QATTN_BACKWARD[kind]
    if options:
        if not hasattr(qattn, "set_backward_options"):
            raise AttentionUnavailable(f"this qattn has no set_backward_options (needed for {options})")
        qattn.set_backward_options(**options)
    label = "qattn.scaled_dot_product_attention (SageBwd INT8 backward"
    label += f", {options})" if options else ", dO·Vᵀ 16-bit)"
    return qattn.scaled_dot_product_attention, label


# ---- data ------------------------------------------------------------------------------


class Batches:
    """Random (batch, ctx + 1) windows of a byte string, from a seeded generator (the same
    sequence of batches in every run of a phase), drawn and gathered on the device so
    that a step never waits for a host-to-device copy."""

    def __init__(self, data: bytes, batch: int, ctx: int, seed: int, device):
        self.data = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
        self.batch, self.ctx = batch, ctx
        self.gen = torch.Generator(device=device).manual_seed(seed)
        self.offsets = torch.arange(ctx + 1, device=device)

    def next(self) -> torch.Tensor:
        starts = torch.randint(0, self.data.numel() - self.ctx - 1, (self.batch, 1), generator=self.gen,
                               device=self.offsets.device)
        return self.data[starts + self.offsets].long()


def val_windows(data: bytes, ctx: int, count: int, device) -> torch.Tensor:
    """`count` windows of ctx + 1 tokens spread evenly over the held-out bytes."""
    t = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    count = max(1, min(count, (t.numel() - 1) // (ctx + 1)))
    starts = torch.linspace(0, t.numel() - ctx - 1, count).long()
    return torch.stack([t[s:s + ctx + 1] for s in starts]).long().to(device)


# ---- one run ---------------------------------------------------------------------------


def autocast(device):
    return torch.autocast(device.type, dtype=torch.bfloat16)


@torch.no_grad()
def evaluate(model, windows, batch, attention, device) -> float:
    model.eval()
    total, count = 0.0, 0
    with autocast(device):
        for i in range(0, windows.shape[0], batch):
            w = windows[i:i + batch]
            total += loss_fn(model, w, attention).item() * w.shape[0]
            count += w.shape[0]
    model.train()
    return total / count


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train_run(name, phase, model, data, val, steps, budget_s, capped, seed, args, device):
    """Trains `model` in place. steps None: calibrate on this run (see the docstring);
    capped: stop at TIME_CAP x budget_s. Returns the run's entry and the step count."""
    attention, label = attention_for(name, args)
    lr = args.lr if phase == "pretrain" else args.finetune_lr
    decay = [p for p in model.parameters() if p.dim() >= 2]
    other = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": other, "weight_decay": 0.0}],
                            lr=lr, betas=(0.9, 0.95), fused=device.type == "cuda")
    batches = Batches(data, args.batch, args.ctx, seed + (0 if phase == "pretrain" else 1), device)
    windows = val_windows(val, args.ctx, args.eval_windows, device)
    entry = {"name": name, "phase": phase, "attention": label, "steps": [], "loss": [],
             "tokens_per_s": None, "val_steps": [], "val_loss": []}
    own = attention is not F.scaled_dot_product_attention
    if own:
        entry["val_loss_own"] = []

    def validate(step):
        entry["val_steps"].append(step)
        entry["val_loss"].append(round(evaluate(model, windows, args.batch, F.scaled_dot_product_attention, device), 5))
        if own:
            entry["val_loss_own"].append(round(evaluate(model, windows, args.batch, attention, device), 5))

    validate(0)
    losses = []
    total = steps
    # Throughput: training steps from cal_start on, without the evaluations.
    train_s, timed_steps, t_mark, mark_step = 0.0, 0, 0.0, None
    cal_start, cal_end = CALIBRATE[0], min(CALIBRATE[1], max(CALIBRATE[0] + 1, args.warmup_steps))
    cal_t0 = 0.0
    sync(device)
    run_start = time.time()
    step = 0
    truncated = False
    while total is None or step < total:
        for group in opt.param_groups:
            group["lr"] = lr_at(step, total or 10 ** 9, lr, args.warmup_steps)
        with autocast(device):
            loss = loss_fn(model, batches.next(), attention)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
        step += 1
        if step == cal_start:  # the steps before warm up kernels and the allocator
            sync(device)
            t_mark = cal_t0 = time.time()
            mark_step = step
        if total is None and step == cal_end:
            sync(device)
            per_step = (time.time() - cal_t0) / (cal_end - cal_start)
            total = max(cal_end, int(budget_s / per_step))
            print(f"  {phase}: {per_step * 1e3:.1f} ms/step over steps {cal_start}-{cal_end} -> {total} steps "
                  f"in {budget_s:.0f} s", flush=True)
        if step % args.eval_every == 0 or step == total:
            sync(device)
            if mark_step is not None and step > mark_step:
                train_s += time.time() - t_mark
                timed_steps += step - mark_step
            t_eval = time.time()
            validate(step)
            if total is None:
                cal_t0 += time.time() - t_eval  # the calibration counts training steps only
            own_txt = f" (own attention {entry['val_loss_own'][-1]:.4f})" if own else ""
            print(f"  {name} {phase} step {step}/{total or '?'}: loss {losses[-1].item():.4f}, "
                  f"val {entry['val_loss'][-1]:.4f}{own_txt}, {time.time() - run_start:.0f} s", flush=True)
            sync(device)
            t_mark = time.time()
            if mark_step is not None:
                mark_step = step
            if capped and time.time() - run_start > TIME_CAP * budget_s and (total is None or step < total):
                truncated = True
                break
    entry["steps"] = list(range(1, len(losses) + 1))
    entry["loss"] = [round(x, 5) for x in torch.stack(losses).float().tolist()]
    if timed_steps and train_s > 0:
        entry["tokens_per_s"] = round(timed_steps * args.batch * args.ctx / train_s)
    entry["tokens"] = len(losses) * args.batch * args.ctx
    entry["wall_s"] = round(time.time() - run_start, 1)
    if truncated:
        entry["truncated"] = f"stopped at {TIME_CAP}x the budget of {budget_s:.0f} s"
    return entry, total


# ---- environment -----------------------------------------------------------------------


def environment(args, device, cfg, params, corpora) -> dict:
    env = {"device": str(device), "torch": torch.__version__, "cuda": torch.version.cuda,
           "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env["gpu"] = props.name
        try:
            smi = subprocess.run(["nvidia-smi", "--query-gpu=clocks.max.sm,driver_version",
                                  "--format=csv,noheader,nounits", "-i", str(device.index or 0)],
                                 capture_output=True, text=True, timeout=20).stdout.strip().split(", ")
        except (OSError, subprocess.SubprocessError):
            smi = []
        env["sm_clock_mhz"] = int(smi[0]) if smi and smi[0].isdigit() else None
        env["driver"] = smi[1] if len(smi) > 1 else ""
    else:
        env.update(gpu=None, sm_clock_mhz=None, driver="")
    commit = args.commit or os.environ.get("QATTN_COMMIT", "")
    if not commit:
        try:
            commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                    cwd=ROOT, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            pass
    env["commit"] = commit or "unknown"
    env["date"] = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    try:
        import qattn

        env["qattn"] = qattn.__version__
    except ImportError:
        env["qattn"] = None
    env["model"] = {**vars(cfg), "parameters": params, "head_dim": cfg.dim // cfg.heads}
    env["training"] = {"batch": args.batch, "tokens_per_step": args.batch * args.ctx, "lr": args.lr,
                       "finetune_lr": args.finetune_lr, "warmup_steps": args.warmup_steps,
                       "schedule": "linear warm-up, cosine to 10%", "optimizer": "AdamW(0.9, 0.95)",
                       "weight_decay": args.weight_decay, "grad_clip": 1.0, "seed": args.seed,
                       "precision": "bf16 autocast, FP32 weights", "tokenizer": "bytes (vocab 256)",
                       "loss": "nats per byte", "eval_windows": args.eval_windows}
    env["corpora"] = {phase: {"name": c.name, "what": c.what, "package_file": c.package_file,
                              "documents": c.documents, "val_documents": c.val_documents,
                              "train_tokens": len(c.train), "val_tokens": len(c.val)}
                      for phase, c in corpora.items()}
    return env


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--corpus-dir", default=str(ROOT / ".deps" / "corpus"))
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--name", default="training-h200")
    ap.add_argument("--commit", default="")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--runs", nargs="+", default=[f"{p}:{n}" for p, n in PLAN],
                    help="a subset of " + " ".join(f"{p}:{n}" for p, n in PLAN + EXTRA)
                    + " (finetune needs pretrain:bf16_sdpa; the last is not run by default)")
    ap.add_argument("--budget-seconds", type=float, default=100, help="pretraining: seconds of the first run")
    ap.add_argument("--finetune-budget-seconds", type=float, default=None, help="default: half of --budget-seconds")
    ap.add_argument("--steps", type=int, default=None, help="pretraining steps (instead of the budget)")
    ap.add_argument("--finetune-steps", type=int, default=None)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=6e-4)
    ap.add_argument("--finetune-lr", type=float, default=3e-4)
    ap.add_argument("--warmup-steps", type=int, default=30)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--eval-windows", type=int, default=64, help="held-out windows of ctx tokens")
    ap.add_argument("--substitute-sdpa", action="store_true",
                    help="run the qattn runs on torch SDPA (a CPU check of the code paths; marked in the output)")
    args = ap.parse_args()
    plan = [tuple(r.split(":", 1)) for r in args.runs]
    for r in plan:
        if r not in PLAN + EXTRA:
            ap.error(f"--runs: {':'.join(r)} is not one of {' '.join(f'{p}:{n}' for p, n in PLAN + EXTRA)}")
    plan = [r for r in PLAN[:2] + EXTRA + PLAN[2:] if r in plan]  # the order above
    if any(p == "finetune" for p, _ in plan) and ("pretrain", "bf16_sdpa") not in plan:
        ap.error("--runs: fine-tuning starts from pretrain:bf16_sdpa's weights; include that run")
    if args.dim % args.heads or (args.dim // args.heads) % 2:
        ap.error(f"--dim {args.dim} / --heads {args.heads}: the head dim must be a whole, even number (rotary pairs)")
    finetune_budget = args.finetune_budget_seconds or args.budget_seconds / 2
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("train.py: no CUDA device (--device cpu --substitute-sdpa checks the code on a CPU)", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = True  # FP32 matmuls outside autocast (none in the hot path)

    corpora = {"pretrain": corpus.load("python-docs", args.corpus_dir)}
    if any(p == "finetune" for p, _ in plan):
        corpora["finetune"] = corpus.load("perl-docs", args.corpus_dir)
    cfg = ModelConfig(layers=args.layers, dim=args.dim, heads=args.heads, ctx=args.ctx)
    torch.manual_seed(args.seed)
    initial = Transformer(cfg).state_dict()
    params = sum(t.numel() for t in initial.values())
    env = environment(args, device, cfg, params, corpora)
    print(f"model: {params / 1e6:.1f} M parameters, {cfg.layers} layers x {cfg.dim}, {cfg.heads} heads of "
          f"{cfg.dim // cfg.heads}, context {cfg.ctx}; {args.batch * args.ctx} tokens per step", flush=True)
    for phase, c in corpora.items():
        print(f"{phase}: {c.what}: {len(c.train) / 1e6:.2f} M training and {len(c.val) / 1e6:.2f} M held-out "
              f"bytes from {c.package_file}", flush=True)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    json_path = out / f"{args.name}.json"
    runs, steps = [], {"pretrain": args.steps, "finetune": args.finetune_steps}
    pretrained = None
    for phase, name in plan:
        budget = args.budget_seconds if phase == "pretrain" else finetune_budget
        c = corpora[phase]
        seed = args.seed + SEED_OFFSET.get(name, 0)
        print(f"{phase} {name}: ", flush=True)
        model = None
        try:
            if phase == "finetune" and pretrained is None:
                raise RuntimeError("no pretrained weights: pretrain bf16_sdpa failed")
            torch.manual_seed(seed)
            model = Transformer(cfg)  # with another seed: its own initial weights
            if seed == args.seed:
                model.load_state_dict(initial if phase == "pretrain" else pretrained)
            model.to(device)
            capped = (args.steps if phase == "pretrain" else args.finetune_steps) is None
            entry, used = train_run(name, phase, model, c.train, c.val, steps[phase], budget, capped, seed, args, device)
            steps[phase] = steps[phase] or used
        except Exception as e:  # qattn unavailable or failing: recorded, the other runs go on
            msg = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e).strip() else ''}"
            print(f"  {name} {phase} failed: {msg}", file=sys.stderr, flush=True)
            entry = {"name": name, "phase": phase, "attention": name, "steps": [], "loss": [],
                     "tokens_per_s": None, "error": msg}
        runs.append(entry)
        if phase == "pretrain" and name == "bf16_sdpa" and "error" not in entry:
            pretrained = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
        env["steps"] = {k: v for k, v in steps.items() if v}
        json_path.write_text(json.dumps({"env": env, "runs": runs}, indent=1) + "\n")

    print(f"\nwrote {json_path}")
    print(f"{'phase':<10}{'run':<16}{'steps':>7}{'tok/s':>10}{'loss':>9}{'val':>9}{'val own':>9}")
    for r in runs:
        if "error" in r:
            print(f"{r['phase']:<10}{r['name']:<16}  error: {r['error'][:80]}")
            continue
        tail = r["loss"][-20:]
        own = f"{r['val_loss_own'][-1]:9.4f}" if r.get("val_loss_own") else f"{'':>9}"
        print(f"{r['phase']:<10}{r['name']:<16}{len(r['steps']):>7}{r['tokens_per_s'] or 0:>10}"
              f"{sum(tail) / len(tail):9.4f}{r['val_loss'][-1]:9.4f}{own}")
    print("(loss: mean of the last 20 steps; val: held-out, evaluated with torch SDPA; val own: with the run's attention)")
    summary = compare_to_bf16(runs)
    for phase, rows in summary.items():
        for name, d in rows.items():
            print(f"{phase} {name}: held-out loss at step {d['step']} {d['val_loss']:.4f} vs bf16_sdpa's "
                  f"{d['bf16_val_loss']:.4f}: {d['delta']:+.4f} nats/byte ({d['delta_percent']:+.2f}%); "
                  f"speed {d['speed_ratio'] or float('nan'):.3f}x bf16_sdpa's tokens/s")
    if summary:
        data = json.loads(json_path.read_text())
        data["summary"] = summary
        json_path.write_text(json.dumps(data, indent=1) + "\n")
    return 0


def compare_to_bf16(runs) -> dict:
    """Per phase, each qattn run's last held-out loss (SDPA-evaluated) against the BF16
    run's at the same step, and its speed ratio."""
    out = {}
    for phase in ("pretrain", "finetune"):
        base = next((r for r in runs if r["phase"] == phase and r["name"] == "bf16_sdpa" and r.get("val_loss")), None)
        if base is None:
            continue
        for r in runs:
            if r["phase"] != phase or r is base or not r.get("val_loss"):
                continue
            common = sorted(set(r["val_steps"]) & set(base["val_steps"]))
            if not common:
                continue
            step = common[-1]
            a, b = r["val_loss"][r["val_steps"].index(step)], base["val_loss"][base["val_steps"].index(step)]
            speed = (r["tokens_per_s"] / base["tokens_per_s"]) if r.get("tokens_per_s") and base.get("tokens_per_s") else None
            out.setdefault(phase, {})[r["name"]] = {
                "step": step, "val_loss": a, "bf16_val_loss": b, "delta": round(a - b, 5),
                "delta_percent": round(100 * (a - b) / b, 3), "speed_ratio": round(speed, 4) if speed else None}
    return out


if __name__ == "__main__":
    sys.exit(main())
