"""Activation recomputation and the bytes a step moves, measured against the planner's predictions.

    .venv/bin/python bench/recompute.py [--quick] [--json] [--limit-mb 1216] [--swap-dir DIR] [--only a,b,c]
                                        [--ram-limit-mb 16384]

Each run is `python -m jnntile.train` in its own process (bench/beyond_ram.py's worker: each step timed
after all its tasks, its swap bytes from jnntile.runtime.stats(), the process's peak RSS):

a. GPT-2 XL's shape (1.48B parameters) under --limit-mb (default 1216: at XL's shape the process adds
   about 750 MB to the limit, its compiled step and JAX, so 2 GiB of peak RSS) with disk swap and
   `--remat auto`, at batch 1 x 64 and 4 x 1024: bytes written to and read from swap per parameter per
   step, beside the planner's prediction (`MemoryPlan.swap_traffic`): at 1 x 64 with the update after the
   backward (`--fused-update off`) and fused into it, speculative under a clip that the norm does not reach
   (`--fused-update on --grad-clip 1e9`), at 4 x 1024 fused so;
b. GPT-2 large's shape (774M) at batch 4 x 1024 with `--remat block` and `--grad-clip 1e9` (a clip the
   norm does not reach, so the update under the limit is speculative and never clips): tokens/s under the
   limit with swap against the same run with no limit (it fits in RAM with recomputation);
c. GPT-2 124M at batch 4 x 1024 in RAM: tokens/s with `--remat none` and `--remat block`;
d. every run's peak RSS beside the planner's peak of the tiles StarPU holds (the process adds its fixed
   overhead: Python, JAX, the compiled step, about 330 MB here);
e. what the speculative update costs when the norm clips: XL's shape at 1 x 64 as in (a) with
   `--grad-clip 1e-6` (clips every step), `--fused-update on` (speculates anyway) and `auto` (the step after
   one that clipped updates after the backward), and the update fused without a clip (`--grad-clip 0`: in
   place, nothing speculative);
f. the schedules of `--grad-accum-steps`: XL's shape as (a) at 4 x 1024 written as `--batch-size 1
   --grad-accum-steps 4`, micro-batch after micro-batch (each reads every weight again) and
   `--grad-accum-schedule layer` (the four through each layer together: (a)'s batch of 4 in tiles of 1).

The last step of each run is the one reported (the first compiles). `--quick` runs the same on models of a few MB (a smoke test).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import beyond_ram  # bench scripts import each other by name

MB = 2 ** 20
XL = ["--n-layer", "48", "--n-head", "25", "--n-embd", "1600"]
LARGE = ["--n-layer", "36", "--n-head", "20", "--n-embd", "1280"]
GPT2_124M = ["--n-layer", "12", "--n-head", "12", "--n-embd", "768"]
QUICK = ["--n-layer", "2", "--n-head", "4", "--n-embd", "128"]


def _batch(batch: int, seq: int) -> list[str]:
    return ["--batch-size", str(batch), "--seq-len", str(seq)]


def _measure(name, shape, *, steps, limit_mb, root, remat, vocab, timeout,
             ram_limit_mb=beyond_ram.NO_LIMIT_MB) -> dict:
    """One training run; its last step, peak RSS and the planner's peak and swap traffic for it. Without
    `limit_mb` the run is in RAM, under `ram_limit_mb` and no swap. `shape` may name the --grad-clip and
    --fused-update of the run (the planner reads them too)."""
    argv_shape = [*shape, "--remat", remat]
    # With swap, --fused-update auto speculates under a clip: the plan must know the run swaps.
    plan = beyond_ram._plan([*argv_shape, *(["--swap-dir", str(root)] if limit_mb else [])], limit_mb or ram_limit_mb,
                            vocab)
    swap_mb = plan.swap_needed_mb(limit_mb) + 1024 if limit_mb else 0
    run_dir = root / name.replace(" ", "-")
    argv = beyond_ram._train_argv(argv_shape, run_dir / "out", steps, limit_mb or ram_limit_mb,
                                  run_dir / "swap" if limit_mb else None, swap_mb)
    result = beyond_ram.run(name, dict(kind="train", save=False, argv=argv), timeout)
    shutil.rmtree(run_dir, ignore_errors=True)
    if "error" in result:
        return dict(run=name, error=result["error"])
    last = result["steps"][-1]
    clip = "--grad-clip" not in shape or float(shape[shape.index("--grad-clip") + 1]) > 0
    predicted = plan.swap_traffic(limit_mb, clip) if limit_mb else (0, 0)
    flag = lambda name, default=None: int(shape[shape.index(name) + 1]) if name in shape else default  # noqa: E731
    tokens = flag("--batch-size") * flag("--seq-len") * flag("--grad-accum-steps", 1)
    return dict(run=name, params=plan.n_params, remat=remat, update=plan.update, limit_mb=limit_mb,
                step_s=last["seconds"],
                tokens_per_s=tokens / last["seconds"], written_mb=last["written_mb"], read_mb=last["read_mb"],
                predicted_written_mb=predicted[0] / MB, predicted_read_mb=predicted[1] / MB,
                peak_rss_mb=result["process_peak_rss_mb"], planned_peak_mb=plan.peak / MB,
                remat_note=" ".join(line for line in result.get("info", []) if "remat" in line))


def _print(rows, out) -> None:
    def p(text=""):
        print(text, file=out)

    p()
    p("| run | remat | update | limit MB | s/step | tokens/s | swap written / read MB (predicted) | bytes/param | "
      "peak RSS MB (planned peak) |")
    p("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            p(f"| {r['run']} | failed: {r['error'][:120]} |")
            continue
        moved = (r["written_mb"] + r["read_mb"]) * MB / r["params"]
        p(f"| {r['run']} | {r['remat']} | {r['update']} | {r['limit_mb'] or 'none'} | {r['step_s']:.1f} | "
          f"{r['tokens_per_s']:.0f} | "
          f"{r['written_mb']:.0f} / {r['read_mb']:.0f} ({r['predicted_written_mb']:.0f} / "
          f"{r['predicted_read_mb']:.0f}) | {moved:.1f} | {r['peak_rss_mb']:.0f} ({r['planned_peak_mb']:.0f}) |")
    by_run = {r["run"]: r for r in rows if "error" not in r}
    for limited, free, what in (("b large limited", "b large in RAM", "GPT-2 large 4x1024, limit+swap / RAM"),
                                ("c 124M remat", "c 124M", "GPT-2 124M 4x1024, recomputation's step-time cost")):
        if limited in by_run and free in by_run:
            ratio = by_run[limited]["tokens_per_s"] / by_run[free]["tokens_per_s"]
            p(f"{what}: {ratio:.2f}x tokens/s" if limited.startswith("b") else f"{what}: {1 / ratio:.2f}x")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="models of a few MB under a 16 MB limit")
    parser.add_argument("--json", action="store_true", help="one JSON object per run on stdout")
    parser.add_argument("--limit-mb", type=int, default=1216, help="--memory-limit-mb of the limited runs")
    parser.add_argument("--swap-dir", default=tempfile.gettempdir())
    parser.add_argument("--only", default="a,b,c,e",
                        help="which measurements (a, b, c, e, f; d is in every row; b-ram: b's run in RAM alone)")
    parser.add_argument("--ram-limit-mb", type=int, default=beyond_ram.NO_LIMIT_MB,
                        help="--memory-limit-mb of the runs in RAM (no swap: the step's tiles must fit)")
    parser.add_argument("--timeout-s", type=float, default=3600, help="per process")
    args = parser.parse_args()
    only = set(args.only.split(","))
    limit = 16 if args.quick else args.limit_mb
    from jnntile import data

    vocab = data.TokenDataset(data.ensure_default_dataset() / "train.bin").vocab_size
    q = args.quick
    runs = []  # (name, shape, steps, limit, remat)
    xl_1x64 = [*(QUICK if q else XL), *_batch(1, 64)]
    not_clipping = ["--fused-update", "on", "--grad-clip", "1e9"]
    if "a" in only:
        runs += [("a XL 1x64", [*xl_1x64, "--fused-update", "off"], 2, limit, "auto"),
                 ("a XL 1x64 fused", [*xl_1x64, *not_clipping], 2, limit, "auto"),
                 ("a XL 4x1024 fused", [*(QUICK if q else XL), *_batch(4, 128 if q else 1024), *not_clipping], 2,
                  limit, "auto")]
    # (b) with a clip the norm does not reach: under the limit the update is speculative (auto, with swap),
    # in RAM after the backward; the same bits.
    large = [*(QUICK if q else LARGE), *_batch(4, 128 if q else 1024), "--grad-clip", "1e9"]
    if "b" in only:
        runs += [("b large limited", large, 2, limit, "block")]
    if only & {"b", "b-ram"}:
        runs += [("b large in RAM", large, 2, None, "block")]
    if "c" in only:
        shape = [*(QUICK if q else GPT2_124M), *_batch(4, 128 if q else 1024)]
        runs += [("c 124M", shape, 3, None, "none"), ("c 124M remat", shape, 3, None, "block")]
    if "e" in only:
        runs += [(f"e XL 1x64 clipping, {setting}", [*xl_1x64, "--fused-update", setting, "--grad-clip", "1e-6"], 2,
                  limit, "auto") for setting in ("on", "auto")]
        runs += [("e XL 1x64 no clip", [*xl_1x64, "--grad-clip", "0"], 2, limit, "auto")]
    if "f" in only:
        accumulated = [*(QUICK if q else XL), *_batch(1, 128 if q else 1024), "--grad-accum-steps", "4", *not_clipping]
        runs += [(f"f XL 4x1024 as 4 micro-batches, {schedule}", [*accumulated, "--grad-accum-schedule", schedule],
                  2, limit, "auto") for schedule in ("micro-batch", "layer")]
    root = Path(tempfile.mkdtemp(prefix="jnntile-bench-recompute-", dir=args.swap_dir))
    started, rows = time.perf_counter(), []
    try:
        for name, shape, steps, limit_mb, remat in runs:
            rows.append(_measure(name, shape, steps=steps, limit_mb=limit_mb, root=root, remat=remat, vocab=vocab,
                                 timeout=args.timeout_s, ram_limit_mb=args.ram_limit_mb))
            if args.json:
                print(json.dumps(rows[-1]), flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    _print(rows, sys.stderr if args.json else sys.stdout)
    print(f"bench wall time {time.perf_counter() - started:.0f} s", file=sys.stderr)
    if any("error" in r for r in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
