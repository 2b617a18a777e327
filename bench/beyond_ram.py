"""Beyond RAM at GPT-2 XL's shape under a 2 GiB peak-RSS budget: train, checkpoint, generate, and the disk's floor.

    .venv/bin/python bench/beyond_ram.py [--quick] [--json] [--budget-mb 2048] [--swap-dir DIR] [--steps 2]

Each measurement runs `python -m jnntile.train` or `python -m jnntile.generate`
in its own process, so its peak RSS (VmHWM) is its own:

1. GPT-2 XL's shape (48 layers, 25 heads, width 1600, the built-in corpus's
   vocabulary; batch 1 x 64) trained --steps steps under --limit-mb (the
   budget less bench/memory.py's CAPACITY_OVERHEAD_MB) with disk swap, then
   checkpointed: peak RSS, each step's time (the first compiles), bytes
   written to and read from swap per step (jnntile.runtime.stats(), after
   waiting for all of the step's tasks), the checkpoint's save time and MB/s;
2. `python -m jnntile.generate` from that checkpoint (its files evicted from
   the page cache first), same limit and swap: peak RSS, load time and MB/s,
   generation tokens/s;
3. the disk's sequential write and read bandwidth with direct I/O
   (bench/memory.py's test), and each training step's I/O floor: bytes
   written / write bandwidth + bytes read / read bandwidth, against its time
   (issue 13's goal: a step within 1.3x its floor);
4. GPT-2 large's shape (36 layers, 20 heads, width 1280; batch 1 x 64) trained
   --large-steps steps under the same limit with swap, and with no limit
   (its ~11 GB of state fits in RAM): tokens/s of each and their ratio (goal:
   at least 0.6).

Step times include waiting for every task of the step (the training command
alone lets the optimizer's tail overlap the next step), so that each step's
swap bytes are its own. Swap uses the default backend (unistd_o_direct: direct
I/O, no page cache). Swap, checkpoint and outputs go to a temporary directory
under --swap-dir, removed at the end. Progress goes to stderr; the tables (or,
with --json, one JSON object per measurement) to stdout. The machine these
numbers come from may be shared: times are noisy.
"""

from __future__ import annotations

import argparse
import collections
import json
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

# Helpers of the sibling benchmarks (bench scripts import each other by name, as gemm.py imports steps).
import checkpoint as bench_checkpoint
from memory import CAPACITY_OVERHEAD_MB, disk_bandwidth, vmhwm_mb

MB = 2 ** 20
BATCH = ["--batch-size", "1", "--seq-len", "64"]
SHAPES = {
    "xl": ["--n-layer", "48", "--n-head", "25", "--n-embd", "1600", *BATCH],
    "large": ["--n-layer", "36", "--n-head", "20", "--n-embd", "1280", *BATCH],
}
QUICK_SHAPES = {  # --quick: the same runs on models of a few MB
    "xl": ["--n-layer", "2", "--n-head", "4", "--n-embd", "128", *BATCH],
    "large": ["--n-layer", "1", "--n-head", "4", "--n-embd", "128", *BATCH],
}
QUICK_LIMIT_MB = 8
PROMPT = "def main("
# RAM and disk are what this measures: on a GPU machine the step would otherwise live in the GPU's memory.
CPU_ONLY = ["--cuda-workers", "0"]
NO_LIMIT_MB = 16384  # the "no limit" run's --memory-limit-mb, as in bench/memory.py


def _progress(*parts) -> None:
    print(*parts, file=sys.stderr, flush=True)


# ---- inside the measured process ------------------------------------------------------------

def worker_train(spec: dict) -> dict:
    """`python -m jnntile.train` with each step's time and swap bytes measured (and its save, when it saves)."""
    import jnntile
    from jnntile.training import checkpoint
    from jnntile import train
    from jnntile.training import step as step_mod

    started = time.perf_counter()
    steps, init = [], {}
    make_steps = step_mod.make_steps

    def measured_make_steps(*args, **kwargs):
        train_step, eval_step = make_steps(*args, **kwargs)

        def step(*step_args):
            if not steps:  # the model's initialisation may still be running (and swapping)
                jnntile.runtime.wait_all()
                written, read = jnntile.runtime.swap_bytes()
                init.update(seconds=time.perf_counter() - started, written_mb=written / MB, read_mb=read / MB)
            before = jnntile.runtime.swap_bytes()
            t0 = time.perf_counter()
            out = train_step(*step_args)
            loss = float(out[2])
            jnntile.runtime.wait_all()  # the optimizer's tasks finish after the loss is read
            seconds = time.perf_counter() - t0
            after = jnntile.runtime.swap_bytes()
            steps.append(dict(seconds=seconds, loss=loss, written_mb=(after[0] - before[0]) / MB,
                              read_mb=(after[1] - before[1]) / MB, peak_rss_mb=vmhwm_mb()))
            _progress(f"    step {len(steps)}: {seconds:.1f} s, {steps[-1]['written_mb']:.0f} MB to and "
                      f"{steps[-1]['read_mb']:.0f} MB from swap, loss {loss:.4f}, peak RSS so far "
                      f"{steps[-1]['peak_rss_mb']:.0f} MB")
            return out

        return step, eval_step

    step_mod.make_steps = measured_make_steps
    if spec["save"]:
        result = bench_checkpoint.worker(spec["argv"])  # times checkpoint.save and its peak RSS on its own
    else:
        checkpoint.save = lambda *args, **kwargs: None
        result = dict(code=train.main(spec["argv"]), calls=[], process_peak_rss_mb=vmhwm_mb())
    return dict(result, steps=steps, init=init)


def worker_generate(spec: dict) -> dict:
    """`python -m jnntile.generate` with the weights' load and the decoding timed apart."""
    import jnntile
    from jnntile import generate
    from jnntile.models import decoding
    from jnntile.models import families

    load, gen = {}, {}
    from_hf, decode = families.from_hf, decoding.Decoder.generate

    def timed_from_hf(*args, **kwargs):
        before, t0 = jnntile.runtime.swap_bytes(), time.perf_counter()
        model = from_hf(*args, **kwargs)
        jnntile.runtime.wait_all()
        after = jnntile.runtime.swap_bytes()
        load.update(seconds=time.perf_counter() - t0, written_mb=(after[0] - before[0]) / MB,
                    read_mb=(after[1] - before[1]) / MB)
        return model

    def timed_generate(self, prompts, max_new_tokens, *, progress=None, **kwargs):
        marks = {}

        def mark(done):  # after each prefill chunk and each one-token step (each reads its logits: a sync point)
            marks[done] = (time.perf_counter(), jnntile.runtime.swap_bytes())
            if progress:
                progress(done)

        t0 = time.perf_counter()
        out = decode(self, prompts, max_new_tokens, progress=mark, **kwargs)
        jnntile.runtime.wait_all()
        gen.update(seconds=time.perf_counter() - t0, new_tokens=len(prompts) * max_new_tokens,
                   prompt_tokens=[len(p) for p in prompts])
        # Steady decoding, as the command reports it: the steps after the first (which compiles).
        first, end = self.prefill_length([len(p) for p in prompts]) + 1, max(marks)
        if end > first:
            seconds = marks[end][0] - marks[first][0]
            gen.update(steady_steps=end - first, steady_tokens_per_s=len(prompts) * (end - first) / seconds,
                       steady_read_mb_per_step=(marks[end][1][1] - marks[first][1][1]) / MB / (end - first),
                       steady_written_mb_per_step=(marks[end][1][0] - marks[first][1][0]) / MB / (end - first))
        return out

    families.from_hf = timed_from_hf
    decoding.Decoder.generate = timed_generate
    code = generate.main(spec["argv"])
    return dict(code=code, load=load, generate=gen, process_peak_rss_mb=vmhwm_mb())


WORKERS = {"train": worker_train, "generate": worker_generate}


# ---- the driver -----------------------------------------------------------------------------

def run(name: str, spec: dict, timeout: float) -> dict:
    """Runs `spec` in a fresh process, its output echoed as progress; returns its result or {"error": ...}."""
    _progress(f"[{name}] {' '.join(spec['argv'])}")
    started = time.perf_counter()
    proc = subprocess.Popen([sys.executable, __file__, "--worker", json.dumps(spec)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, bufsize=1)
    result, info, tail = None, [], collections.deque(maxlen=30)
    timer = threading.Timer(timeout, proc.kill)
    timer.start()
    for line in proc.stdout:
        line = line.rstrip("\n")
        if line.startswith("RESULT "):
            result = json.loads(line[len("RESULT "):])
            continue
        tail.append(line)
        if line.startswith(("GPT-2", "automatic tiles", "--remat")):
            info.append(line)
        _progress(f"  [{name}] {line}")
    code = proc.wait()
    timer.cancel()
    wall = time.perf_counter() - started
    if result is None or code != 0 or result.get("code") != 0:
        error = (f"timed out after {timeout:.0f} s" if wall > timeout else f"exit status {code}") + ": " + \
            " | ".join(list(tail)[-5:])
        _progress(f"[{name}] FAILED after {wall:.0f} s: {error}")
        return dict(error=error, wall_s=wall)
    _progress(f"[{name}] done in {wall:.0f} s")
    return dict(result, wall_s=wall, info=info)


def _plan(shape: list[str], limit_mb: int, vocab_size: int):
    """jnntile.memory's plan of the training step these flags describe (tiles fitted to the limit, as train does)."""
    from jnntile import memory

    parser = argparse.ArgumentParser()
    memory.add_arguments(parser)
    return memory.plan_from_args(parser.parse_args([*shape, "--vocab-size", str(vocab_size),
                                                    "--memory-limit-mb", str(limit_mb), *CPU_ONLY]))


class Report:
    """The measurements: one JSON line each with --json, and the tables at the end."""

    def __init__(self, as_json: bool):
        self.as_json, self.rows = as_json, []

    def add(self, measurement: str, **values) -> dict:
        row = dict(measurement=measurement, **values)
        self.rows.append(row)
        if self.as_json:
            print(json.dumps(row), flush=True)
        return row


def _train_argv(shape, out: Path, steps: int, limit_mb: int | None, swap_dir: Path | None, swap_mb: int) -> list[str]:
    argv = [*shape, "--steps", str(steps), "--samples", "0", "--eval-interval", "0", "--checkpoint-interval", "0",
            "--quiet", "--out", str(out), *CPU_ONLY]
    if limit_mb is not None:
        argv += ["--memory-limit-mb", str(limit_mb)]
    if swap_dir is not None:
        argv += ["--swap-dir", str(swap_dir), "--swap-size-mb", str(swap_mb)]
    return argv


def _io_floor(step: dict, bandwidth: tuple[float, float]) -> float:
    return step["written_mb"] / bandwidth[0] + step["read_mb"] / bandwidth[1]


def _tokens_per_s(result: dict, tokens_per_step: int) -> float:
    timed = result["steps"][1:] or result["steps"]  # the first step compiles
    return tokens_per_step * len(timed) / sum(s["seconds"] for s in timed)


def measure_xl(args, report, root, shape, limit, bandwidth, vocab) -> Path | None:
    """1: train and checkpoint; returns the checkpoint directory."""
    plan = _plan(shape, limit, vocab)
    swap_mb = plan.swap_needed_mb(limit) + 1024
    out = root / "xl"
    _progress(f"\n(1) XL shape: {plan.n_params / 1e6:.0f}M parameters, {plan.state / MB:.0f} MB of parameters, "
              f"gradients and AdamW state, planned peak {plan.peak / MB:.0f} MB; limit {limit} MB, swap {swap_mb} MB, "
              f"{args.steps} steps, then a checkpoint")
    r = run("xl train", dict(kind="train", save=True,
                             argv=_train_argv(shape, out, args.steps, limit, root / "swap", swap_mb)), args.timeout_s)
    if "error" in r:
        report.add("xl_train", error=r["error"])
        return None
    ckpt = out / (out / "latest").read_text().strip()
    files = [ckpt / name for name in bench_checkpoint.FILES]
    nbytes = sum(p.stat().st_size for p in files)
    fsync_s = bench_checkpoint._fsync_seconds(files)
    save = next(c for c in r["calls"] if c["call"] == "save")
    for i, step in enumerate(r["steps"], 1):
        floor = _io_floor(step, bandwidth)
        report.add("xl_train_step", step=i, seconds=step["seconds"], written_mb=step["written_mb"],
                   read_mb=step["read_mb"], io_floor_s=floor, step_over_floor=step["seconds"] / floor if floor else None,
                   compiles=i == 1, loss=step["loss"])
    report.add("xl_train", n_params=plan.n_params, state_mb=plan.state / MB, limit_mb=limit, budget_mb=args.budget_mb,
               swap_mb=swap_mb, peak_rss_mb=r["process_peak_rss_mb"],
               peak_rss_steps_mb=max(s["peak_rss_mb"] for s in r["steps"]), init_s=r["init"]["seconds"],
               init_written_mb=r["init"]["written_mb"], tokens_per_s=_tokens_per_s(r, 64), info=r["info"],
               wall_s=r["wall_s"])
    report.add("xl_checkpoint_save", checkpoint_mb=nbytes / MB, seconds=save["seconds"],
               mb_per_s=nbytes / MB / save["seconds"], fsync_s=fsync_s, peak_rss_mb=save["peak_rss_mb"],
               rss_at_start_mb=save["rss_at_start_mb"])
    return ckpt


def measure_generate(args, report, root, ckpt: Path, limit, bandwidth) -> None:
    """2: generate from the checkpoint, its files read from the disk."""
    from jnntile.models.gpt2.config import GPT2Config

    config = GPT2Config.from_hf_dict(json.loads((ckpt / "config.json").read_text()))
    weights_mb = 4 * config.n_params() / MB
    swap_mb = int(weights_mb) + 1024
    model_file = ckpt / "model.safetensors"
    bench_checkpoint._evict_from_page_cache([ckpt / name for name in bench_checkpoint.FILES])
    _progress(f"\n(2) generate {args.max_new_tokens} tokens from {ckpt} ({weights_mb:.0f} MB of weights, evicted "
              f"from the page cache), limit {limit} MB, swap {swap_mb} MB")
    argv = ["--checkpoint", str(ckpt), "--prompt", PROMPT, "--max-new-tokens", str(args.max_new_tokens),
            "--temperature", "0", "--quiet", "--memory-limit-mb", str(limit), "--swap-dir", str(root / "swap"),
            "--swap-size-mb", str(swap_mb), *CPU_ONLY]
    r = run("xl generate", dict(kind="generate", argv=argv), args.timeout_s)
    if "error" in r:
        report.add("xl_generate", error=r["error"])
        return
    load, gen = r["load"], r["generate"]
    file_mb = model_file.stat().st_size / MB
    steady = gen.get("steady_tokens_per_s")
    floor = (_io_floor(dict(written_mb=gen["steady_written_mb_per_step"], read_mb=gen["steady_read_mb_per_step"]),
                       bandwidth) if steady else None)
    report.add("xl_generate", peak_rss_mb=r["process_peak_rss_mb"], limit_mb=limit, load_s=load["seconds"],
               model_file_mb=file_mb, load_mb_per_s=file_mb / load["seconds"], load_written_mb=load["written_mb"],
               load_read_mb=load["read_mb"], prompt_tokens=gen["prompt_tokens"], new_tokens=gen["new_tokens"],
               generate_s=gen["seconds"], tokens_per_s=gen["new_tokens"] / gen["seconds"],
               steady_tokens_per_s=gen.get("steady_tokens_per_s"), steady_steps=gen.get("steady_steps"),
               steady_read_mb_per_token=gen.get("steady_read_mb_per_step"),
               steady_written_mb_per_token=gen.get("steady_written_mb_per_step"), steady_io_floor_s_per_token=floor,
               steady_over_floor=1 / steady / floor if floor else None, info=r["info"], wall_s=r["wall_s"])


def measure_large(args, report, root, shape, limit, bandwidth, vocab) -> None:
    """4: the large shape with the limit and swap, then without a limit."""
    plan = _plan(shape, limit, vocab)
    swap_mb = plan.swap_needed_mb(limit) + 1024
    no_limit = max(NO_LIMIT_MB, int(plan.peak / MB * 1.2))
    _progress(f"\n(4) large shape: {plan.n_params / 1e6:.0f}M parameters, {plan.state / MB:.0f} MB of state, planned "
              f"peak {plan.peak / MB:.0f} MB; {args.large_steps} steps under {limit} MB + {swap_mb} MB of swap, then "
              f"under {no_limit} MB without swap")
    results = {}
    for name, (lim, swap) in {"limited": (limit, root / "swap"), "unlimited": (no_limit, None)}.items():
        r = run(f"large {name}", dict(kind="train", save=False, argv=_train_argv(
            shape, root / f"large-{name}", args.large_steps, lim, swap, swap_mb)), args.timeout_s)
        if "error" in r:
            report.add(f"large_{name}", error=r["error"])
            continue
        timed = r["steps"][1:] or r["steps"]
        written = sum(s["written_mb"] for s in timed) / len(timed)
        read = sum(s["read_mb"] for s in timed) / len(timed)
        step_s = sum(s["seconds"] for s in timed) / len(timed)
        floor = (written / bandwidth[0] + read / bandwidth[1]) if swap else 0.0
        results[name] = report.add(
            f"large_{name}", limit_mb=lim, swap=swap is not None, peak_rss_mb=r["process_peak_rss_mb"],
            step_s=[s["seconds"] for s in r["steps"]], tokens_per_s=_tokens_per_s(r, 64), written_mb_per_step=written,
            read_mb_per_step=read, io_floor_s=floor, step_over_floor=step_s / floor if floor else None,
            losses=[s["loss"] for s in r["steps"]], state_mb=plan.state / MB, info=r["info"], wall_s=r["wall_s"])
    if len(results) == 2:
        same = results["limited"]["losses"] == results["unlimited"]["losses"]
        report.add("large_ratio", ratio=results["limited"]["tokens_per_s"] / results["unlimited"]["tokens_per_s"],
                   goal=0.6, losses_identical=same)


def print_tables(report: Report, bandwidth, out) -> None:
    rows = {}
    for row in report.rows:
        rows.setdefault(row["measurement"], []).append(row)

    def p(text=""):
        print(text, file=out, flush=True)

    def one(name):
        return rows.get(name, [{}])[0]

    p("\nbeyond RAM (this machine may be shared with other jobs: times are noisy; compare within one run)")
    p(f"disk, sequential with direct I/O: write {bandwidth[0]:.0f} MB/s, read {bandwidth[1]:.0f} MB/s")
    xl = one("xl_train")
    if "error" in xl:
        p(f"XL training FAILED: {xl['error']}")
    elif xl:
        within = "within" if xl["peak_rss_mb"] <= xl["budget_mb"] else "OVER"
        p(f"XL shape: {xl['n_params'] / 1e6:.0f}M parameters, {xl['state_mb'] / 1024:.1f} GB of state; limit "
          f"{xl['limit_mb']} MB, peak RSS {xl['peak_rss_mb']:.0f} MB ({within} the {xl['budget_mb']} MB budget; "
          f"{xl['peak_rss_steps_mb']:.0f} MB during the steps); init {xl['init_s']:.0f} s, "
          f"{xl['init_written_mb']:.0f} MB to swap")
        p(f"{'XL step':>8} {'seconds':>8} {'to swap':>8} {'from swap':>9} {'I/O floor':>9} {'step /':>7}")
        p(f"{'':>8} {'':>8} {'MB':>8} {'MB':>9} {'s':>9} {'floor':>7}")
        for s in rows.get("xl_train_step", []):
            ratio = f"{s['step_over_floor']:7.2f}" if s["step_over_floor"] else f"{'-':>7}"
            p(f"{s['step']:>8} {s['seconds']:8.1f} {s['written_mb']:8.0f} {s['read_mb']:9.0f} {s['io_floor_s']:9.1f} "
              f"{ratio}" + ("  (compiles)" if s["compiles"] else ""))
        save = one("xl_checkpoint_save")
        p(f"checkpoint save: {save['checkpoint_mb']:.0f} MB in {save['seconds']:.1f} s = {save['mb_per_s']:.0f} MB/s "
          f"(into the page cache; fsync after: {save['fsync_s']:.1f} s), peak RSS in the save "
          f"{save['peak_rss_mb']:.0f} MB")
    gen = one("xl_generate")
    if "error" in gen:
        p(f"generation FAILED: {gen['error']}")
    elif gen:
        steady = (f"; steady decoding {gen['steady_tokens_per_s']:.2f} tokens/s over {gen['steady_steps']} steps, "
                  f"{gen['steady_read_mb_per_token']:.0f} MB read from swap per token"
                  + (f" (I/O floor {gen['steady_io_floor_s_per_token']:.1f} s per token; "
                     f"{gen['steady_over_floor']:.2f}x)" if gen["steady_over_floor"] else "")
                  if gen.get("steady_tokens_per_s") else "")
        p(f"generate: peak RSS {gen['peak_rss_mb']:.0f} MB; load {gen['model_file_mb']:.0f} MB of weights in "
          f"{gen['load_s']:.1f} s = {gen['load_mb_per_s']:.0f} MB/s (model built, initialised and overwritten: "
          f"{gen['load_written_mb']:.0f} MB to swap); "
          f"{gen['new_tokens']} new tokens after a {gen['prompt_tokens'][0]}-token prompt in {gen['generate_s']:.1f} s "
          f"= {gen['tokens_per_s']:.2f} tokens/s (with compilation and prefill, without the load){steady}")
    if "large_limited" in rows or "large_unlimited" in rows:
        p(f"{'large':>10} {'limit MB':>8} {'peak RSS':>8} {'tokens/s':>8} {'s/step':>18} {'to swap':>8} "
          f"{'from swap':>9} {'I/O floor':>9} {'step /':>7}")
        p(f"{'':>10} {'':>8} {'MB':>8} {'':>8} {'':>18} {'MB/step':>8} {'MB/step':>9} {'s':>9} {'floor':>7}")
        for name in ("limited", "unlimited"):
            r = one(f"large_{name}")
            if "error" in r:
                p(f"{name:>10} FAILED: {r['error']}")
                continue
            ratio = f"{r['step_over_floor']:7.2f}" if r["step_over_floor"] else f"{'-':>7}"
            p(f"{name:>10} {r['limit_mb']:8} {r['peak_rss_mb']:8.0f} {r['tokens_per_s']:8.2f} "
              f"{', '.join(f'{s:.1f}' for s in r['step_s']):>18} {r['written_mb_per_step']:8.0f} "
              f"{r['read_mb_per_step']:9.0f} {r['io_floor_s']:9.1f} {ratio}")
        ratio = one("large_ratio")
        if ratio:
            p(f"large, limited / unlimited tokens/s: {ratio['ratio']:.2f} (goal >= {ratio['goal']}); losses "
              f"{'identical' if ratio['losses_identical'] else 'DIFFERENT'}")
    p("tokens/s and s/step leave out the first step (it compiles); the I/O floor is a step's swap bytes at the "
      "disk's sequential bandwidth (goal: step <= 1.3x floor)")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true",
                        help=f"models of a few MB under a {QUICK_LIMIT_MB} MB limit (a smoke test of this script)")
    parser.add_argument("--json", action="store_true", help="one JSON object per measurement on stdout")
    parser.add_argument("--budget-mb", type=int, default=None,
                        help="peak-RSS budget (default 2048; with --quick, the limit + the overhead)")
    parser.add_argument("--limit-mb", type=int, default=None,
                        help=f"--memory-limit-mb of the limited runs (default: the budget - {CAPACITY_OVERHEAD_MB}, "
                             f"bench/memory.py's fixed overhead; {QUICK_LIMIT_MB} with --quick)")
    parser.add_argument("--swap-dir", default=tempfile.gettempdir(),
                        help="where swap, checkpoint and outputs go (a temporary directory in it, removed at the end)")
    parser.add_argument("--steps", type=int, default=2, help="XL training steps before the checkpoint")
    parser.add_argument("--large-steps", type=int, default=4, help="steps of each large run (the first compiles)")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--disk-test-mb", type=int, default=None, help="size of the disk test (default 1024; 64 quick)")
    parser.add_argument("--skip-large", action="store_true", help="leave out measurement 4")
    parser.add_argument("--timeout-s", type=float, default=3600, help="per process")
    args = parser.parse_args()
    if args.worker:
        spec = json.loads(args.worker)
        print("RESULT " + json.dumps(WORKERS[spec["kind"]](spec)), flush=True)
        return

    shapes = QUICK_SHAPES if args.quick else SHAPES
    limit = args.limit_mb or (QUICK_LIMIT_MB if args.quick else (args.budget_mb or 2048) - CAPACITY_OVERHEAD_MB)
    args.budget_mb = args.budget_mb or (limit + CAPACITY_OVERHEAD_MB if args.quick else 2048)
    disk_mb = args.disk_test_mb or (64 if args.quick else 1024)
    from jnntile import data

    vocab = data.TokenDataset(data.ensure_default_dataset() / "train.bin").vocab_size
    report = Report(args.json)
    started = time.perf_counter()
    root = Path(tempfile.mkdtemp(prefix="jnntile-bench-beyond-ram-", dir=args.swap_dir))
    try:
        bandwidth = disk_bandwidth(root, disk_mb)
        report.add("disk", write_mb_per_s=bandwidth[0], read_mb_per_s=bandwidth[1], test_mb=disk_mb,
                   directory=args.swap_dir)
        _progress(f"disk under {args.swap_dir}: sequential write {bandwidth[0]:.0f} MB/s, read {bandwidth[1]:.0f} MB/s "
                  f"(direct I/O, {disk_mb} MB)")
        ckpt = measure_xl(args, report, root, shapes["xl"], limit, bandwidth, vocab)
        if ckpt is not None:
            measure_generate(args, report, root, ckpt, limit, bandwidth)
            shutil.rmtree(root / "xl", ignore_errors=True)  # room on the disk for what follows
        if not args.skip_large:
            measure_large(args, report, root, shapes["large"], limit, bandwidth, vocab)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    report.add("bench", wall_s=time.perf_counter() - started, quick=args.quick)
    print_tables(report, bandwidth, sys.stderr if args.json else sys.stdout)
    _progress(f"bench wall time {time.perf_counter() - started:.0f} s")
    if any("error" in row for row in report.rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
