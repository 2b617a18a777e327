"""Checkpoints of models larger than the memory limit: save and restore speed and peak RSS.

    .venv/bin/python bench/checkpoint.py [--model 242m|xl] [--limit-mb 512] [--swap-dir /tmp]

Runs `python -m jnntile.train` three times, each in its own process: train
(--steps N) and save the final checkpoint, resume from it (--resume, one more
step) and export the weights for Hugging Face (--export-hf). Inside each, the
checkpoint calls are timed and the peak RSS during each call is measured on its
own (VmHWM from /proc/self/status, reset to the RSS at the start of the call
through /proc/self/clear_refs), next to the RSS at its start and the peak RSS of
the whole process.

MB/s counts the bytes of the files written or read (model.safetensors and
optimizer.safetensors). Saving writes into the kernel's page cache (no fsync;
the "fsync s" column is the time to flush the files afterwards). Restoring is
measured twice: right after the save (files in the page cache) and with the
files evicted from the page cache first (posix_fadvise DONTNEED after an
fsync), which reads them from the disk. StarPU's swap also goes through the
page cache. The machine is shared: times are noisy.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MB = 2 ** 20
MODELS = {
    "tiny": ["--model", "tiny", "--batch-size", "2", "--seq-len", "32"],  # a smoke test of this script
    # 242M parameters with the built-in corpus's 4096-token vocabulary: 3.9 GB of
    # parameters, gradients and AdamW state.
    "242m": ["--n-layer", "12", "--n-head", "16", "--n-embd", "1280", "--batch-size", "1", "--seq-len", "64"],
    # GPT-2 XL's shape (1.5B parameters with a 50257-token vocabulary, 25 GB of
    # state; 1.56B with the corpus's 4096).
    "xl": ["--n-layer", "48", "--n-head", "25", "--n-embd", "1600", "--batch-size", "1", "--seq-len", "64"],
}
FILES = ("model.safetensors", "optimizer.safetensors")


def _status_mb(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _reset_peak_rss() -> None:
    # "5" resets VmHWM to the current RSS (Linux >= 4.0).
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def worker(argv: list[str]) -> dict:
    """Runs the training CLI with its checkpoint calls timed; returns what was measured."""
    from jnntile.training import checkpoint
    from jnntile import train
    from jnntile.models import families

    calls, depth = [], []

    def timed(name, fn):
        def wrapper(*args, **kwargs):
            if depth:  # checkpoint.save calls save_hf: measured as part of the save
                return fn(*args, **kwargs)
            depth.append(name)
            before_mb = _status_mb("VmHWM")
            start_mb = _status_mb("VmRSS")
            _reset_peak_rss()
            started = time.perf_counter()
            out = fn(*args, **kwargs)
            calls.append(dict(call=name, seconds=time.perf_counter() - started, peak_rss_mb=_status_mb("VmHWM"),
                              peak_before_mb=before_mb, rss_at_start_mb=start_mb))
            depth.pop()
            return out
        return wrapper

    checkpoint.save = timed("save", checkpoint.save)
    checkpoint.restore = timed("restore", checkpoint.restore)
    families.save_hf = timed("export_hf", families.save_hf)
    code = train.main(argv)
    return dict(code=code, calls=calls, process_peak_rss_mb=max([_status_mb("VmHWM")] +
                                                                 [c["peak_rss_mb"] for c in calls] +
                                                                 [c["peak_before_mb"] for c in calls]))


def run(argv: list[str], timeout: float) -> dict:
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, __file__, "--worker", json.dumps(argv)], capture_output=True, text=True,
                          timeout=timeout)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{' '.join(argv)} failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    result = json.loads(lines[-1][len("RESULT "):])
    if result["code"] != 0:
        raise RuntimeError(f"{' '.join(argv)} exited with {result['code']}:\n{proc.stderr[-3000:]}")
    result["wall_s"] = time.perf_counter() - started
    result["stdout"] = proc.stdout
    return result


def _evict_from_page_cache(paths) -> None:
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)  # dirty pages cannot be dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _fsync_seconds(paths) -> float:
    started = time.perf_counter()
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    return time.perf_counter() - started


def _print_table(rows, files, nbytes, exported):
    print(f"\ncheckpoint: {nbytes / MB:.0f} MB ({', '.join(f'{p.name} {p.stat().st_size / MB:.0f} MB' for p in files)})"
          + (f"; Hugging Face export: {exported / MB:.0f} MB" if exported else ""))
    print(f"{'run':<36} {'call':<10} {'seconds':>8} {'MB/s':>7} {'RSS at':>7} {'peak RSS':>9} {'peak RSS':>9} "
          f"{'fsync s':>8}")
    print(f"{'':<36} {'':<10} {'':>8} {'':>7} {'start':>7} {'in call':>9} {'process':>9} {'':>8}")
    for label, result, fsync in rows:
        for c in result["calls"]:
            size = exported if c["call"] == "export_hf" else nbytes
            fs = f"{fsync:8.1f}" if fsync is not None and c["call"] == "save" else f"{'':>8}"
            print(f"{label:<36} {c['call']:<10} {c['seconds']:8.1f} {size / MB / c['seconds']:7.0f} "
                  f"{c['rss_at_start_mb']:7.0f} {c['peak_rss_mb']:9.0f} {result['process_peak_rss_mb']:9.0f} {fs}")


def _losses(out: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--model", choices=list(MODELS), default="242m")
    parser.add_argument("--limit-mb", type=int, default=512, help="--memory-limit-mb of every run")
    parser.add_argument("--steps", type=int, default=3, help="steps before the checkpoint")
    parser.add_argument("--swap-dir", default=tempfile.gettempdir(), help="where the swap and the outputs go")
    parser.add_argument("--swap-size-mb", type=int, default=16384, help="--swap-size-mb of every run")
    parser.add_argument("--save-only", action="store_true",
                        help="only the first run (train and save): resuming needs room for two checkpoints")
    parser.add_argument("--timeout-s", type=float, default=7200, help="per run")
    args = parser.parse_args()
    if args.worker:
        print("RESULT " + json.dumps(worker(json.loads(args.worker))), flush=True)
        return

    root = Path(tempfile.mkdtemp(prefix="jnntile-bench-checkpoint-", dir=args.swap_dir))
    out, export = root / "out", root / "hf"
    common = [*MODELS[args.model], "--memory-limit-mb", str(args.limit_mb), "--swap-dir", str(root / "swap"),
              "--swap-size-mb", str(args.swap_size_mb), "--samples", "0", "--eval-interval", "0",
              "--checkpoint-interval", "0", "--quiet", "--out", str(out)]
    print(f"bench/checkpoint.py: {args.model} ({' '.join(MODELS[args.model])}) under --memory-limit-mb "
          f"{args.limit_mb} with swap in {root}", flush=True)
    try:
        rows = []
        first = run([*common, "--steps", str(args.steps)], args.timeout_s)
        print(first["stdout"].strip().splitlines()[0], flush=True)
        rows_of_metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        print("training steps took " + ", ".join(f"{r['seconds']:.0f} s" for r in rows_of_metrics), flush=True)
        ckpt = out / (out / "latest").read_text().strip()
        files = [ckpt / name for name in FILES]
        nbytes = sum(p.stat().st_size for p in files)
        fsync_s = _fsync_seconds(files)
        rows.append(("train + save", first, fsync_s))
        exported = None
        if args.save_only:
            _print_table(rows, files, nbytes, exported)
            return
        warm = run([*common, "--steps", str(args.steps + 1), "--resume"], args.timeout_s)
        rows.append(("resume (files in page cache)", warm, None))
        warm_loss = _losses(out)[-1]
        # The resumed run saved a newer checkpoint; restore the same one again, from the disk.
        (out / "latest").write_text(ckpt.name)
        shutil.rmtree(out / f"ckpt-{args.steps + 1:07d}")
        _evict_from_page_cache(files)
        cold = run([*common, "--steps", str(args.steps + 1), "--resume", "--export-hf", str(export)], args.timeout_s)
        rows.append(("resume (files from disk) + export", cold, None))
        exported = (export / "model.safetensors").stat().st_size

        _print_table(rows, files, nbytes, exported)
        print(f"step {args.steps} loss after resuming from the page cache / from the disk: "
              f"{warm_loss} / {_losses(out)[-1]} ({'identical' if warm_loss == _losses(out)[-1] else 'DIFFERENT'})")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
