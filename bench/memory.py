"""Beyond RAM: training GPT-2 under a memory limit with disk swap.

    .venv/bin/python bench/memory.py [--quick] [--budget-mb 2048] [--swap-dir /tmp]

Every configuration runs in its own subprocess, so its peak RSS (VmHWM from
/proc/self/status) is its own. Prints three tables:

(a) a GPT-2 whose parameters + gradients + AdamW state are over 3x the memory
    limit: peak RSS against the limit, and the losses against an unlimited
    run of the same model (bitwise);
(b) tokens/s with the limit and without it, and bytes written to / read from
    swap per step, with and without the invalidation of dead tiles (DESIGN
    invariant 7: backward rules release activations, optimizers consume
    gradients, gradients start at zero lazily), with each swap backend:
    unistd (through the page cache) and unistd_o_direct (direct I/O); the
    page cache the swap files hold at the end (RAM the process uses beyond its
    RSS), and the I/O floor of a step (its swap bytes at the disk's sequential
    bandwidth, measured in the same run with direct I/O) next to its time;
(c) capacity under one RSS budget: the largest GPT-2 the pure-JAX reference
    (jnntile/models/gpt2/reference.py + optax.adamw, jitted, state donated) trains
    within it, from its measured peak RSS at a few sizes, next to a GPT-2 that
    jnntile trains within the same budget with disk swap (its memory limit is
    the budget minus 640 MB for its fixed overhead).

With the unistd backend, swap files go through the page cache, which RSS does
not count: the disk traffic is real (bytes counted by StarPU's bus counters,
equal to the bytes the backend writes), but on a machine with free RAM much of
it is served by the kernel's cache rather than the device, and the cache holds
a second copy of the swap in RAM. unistd_o_direct reads and writes the device.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import subprocess
import sys
import tempfile
import time

MB = 2 ** 20
CAPACITY_OVERHEAD_MB = 640  # RSS beyond the memory limit allowed for the big model of (c)
BACKEND_REPEATS = 2  # runs per swap backend in (b)


def vmhwm_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def page_cache_mb(directory) -> float:
    """MB of the files under `directory` resident in the page cache (mincore on each file)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)
    libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
    libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p)
    page, resident = mmap.PAGESIZE, 0
    for root, _, files in os.walk(directory):
        for name in files:
            try:
                fd = os.open(os.path.join(root, name), os.O_RDONLY)
            except OSError:  # removed meanwhile
                continue
            try:
                size = os.fstat(fd).st_size
                if size == 0:
                    continue
                address = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
                if address in (None, ctypes.c_void_p(-1).value):
                    continue
                pages = (size + page - 1) // page
                vector = ctypes.create_string_buffer(pages)
                if libc.mincore(address, size, vector) == 0:
                    resident += sum(byte & 1 for byte in vector.raw)
                libc.munmap(address, size)
            finally:
                os.close(fd)
    return resident * page / MB


def disk_bandwidth(directory, size_mb: int, block_mb: int = 8) -> tuple[float, float]:
    """Sequential (write, read) bandwidth in MB/s of the disk under `directory`, with direct I/O.

    Direct I/O, so that the page cache neither absorbs the writes nor serves
    the reads; fsync before the write clock stops.
    """
    path = os.path.join(directory, "bandwidth-test")
    block = mmap.mmap(-1, block_mb * MB)  # page-aligned, as O_DIRECT wants
    block.write(os.urandom(MB) * block_mb)
    blocks = max(1, size_mb // block_mb)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o600)
    try:
        started = time.perf_counter()
        for _ in range(blocks):
            os.write(fd, block)
        os.fsync(fd)
        write_s = time.perf_counter() - started
        os.lseek(fd, 0, os.SEEK_SET)
        started = time.perf_counter()
        for _ in range(blocks):
            os.readv(fd, [block])
        read_s = time.perf_counter() - started
    finally:
        os.close(fd)
        os.unlink(path)
    return blocks * block_mb / write_s, blocks * block_mb / read_s


def _config(spec):
    from jnntile.models.gpt2.config import GPT2Config

    return GPT2Config(**spec["config"])


def _batches(config, batch, seq, steps, seed=0):
    import numpy as np

    rng = np.random.default_rng(seed)
    return [tuple(rng.integers(0, config.vocab_size, (batch, seq)).astype(np.int32) for _ in range(2))
            for _ in range(steps)]


def worker_jnntile(spec) -> dict:
    from flax import nnx

    import jnntile
    from jnntile.training import optim
    from jnntile import planning
    from jnntile.models import gpt2
    from jnntile.ops import _ffi
    from jnntile.training.step import make_steps

    _ffi.RELEASE = spec.get("release", True)
    _ffi.LAZY_ZERO = spec.get("release", True)
    config = _config(spec)
    B, T, steps = spec["batch"], spec["seq"], spec["steps"]
    settings = dict(memory_limit_mb=spec["limit_mb"], watchdog_s=300)
    if spec.get("swap_mb"):
        settings.update(swap_dir=spec["swap_dir"], swap_size_mb=spec["swap_mb"],
                        swap_backend=spec.get("swap_backend", jnntile.runtime.config().swap_backend))
    jnntile.runtime.start(**settings)
    plan = planning.plan(planning.StepSpec(config, B, T))
    verdict = plan.check(planning.Limits(spec["limit_mb"], spec.get("swap_mb", 0)))
    started = time.perf_counter()
    model = gpt2.GPT2(config, batch_size=B, seq_len=T, seed=0)
    graphdef, params = nnx.split(model, nnx.Param)
    tx = optim.adamw(1e-3, weight_decay=0.01)
    opt_state = tx.init(params)
    del model
    train_step, _ = make_steps(graphdef, tx)

    jnntile.runtime.wait_all()
    init_s = time.perf_counter() - started
    losses, times, written, read = [], [], [], []
    jnntile.runtime.reset_peaks()
    for idx, targets in _batches(config, B, T, steps):
        before = jnntile.runtime.stats()["bytes_moved"]
        t0 = time.perf_counter()
        params, opt_state, loss = train_step(params, opt_state, idx[None], targets[None], [None])
        losses.append(float(loss))
        jnntile.runtime.wait_all()  # the optimizer's tasks finish after the loss is read
        times.append(time.perf_counter() - t0)
        after = jnntile.runtime.stats()["bytes_moved"]
        written.append(after.get("RAM->DISK", 0) - before.get("RAM->DISK", 0))
        read.append(after.get("DISK->RAM", 0) - before.get("DISK->RAM", 0))
    nodes = {n["kind"]: n for n in jnntile.runtime.stats()["nodes"]}
    own_swap = [os.path.join(spec["swap_dir"], d) for d in os.listdir(spec["swap_dir"])
                if d.startswith(f"jnntile-swap-{os.getpid()}-")] if spec.get("swap_mb") else []
    cached_mb = sum(page_cache_mb(d) for d in own_swap)
    steady = slice(1, None) if steps > 1 else slice(None)  # the first step compiles
    return dict(losses=losses, step_s=times, init_s=init_s,
                tokens_per_s=B * T * len(times[steady]) / sum(times[steady]),
                written_mb=sum(written[steady]) / len(written[steady]) / MB,
                read_mb=sum(read[steady]) / len(read[steady]) / MB,
                starpu_peak_mb=nodes["RAM"]["peak_used_bytes"] / MB,
                disk_peak_mb=nodes["DISK"]["peak_used_bytes"] / MB if "DISK" in nodes else 0.0,
                plan_peak_mb=plan.peak / MB, plan_state_mb=plan.state / MB, verdict=verdict,
                n_params=plan.n_params, vmhwm_mb=vmhwm_mb(), page_cache_mb=cached_mb,
                swap_backend=jnntile.runtime.config().swap_backend if spec.get("swap_mb") else None)


def worker_reference(spec) -> dict:
    import jax
    import optax

    from jnntile.models.gpt2 import reference as ref

    config = _config(spec)
    B, T, steps = spec["batch"], spec["seq"], spec["steps"]
    params = ref.init_params(config, seed=0)
    tx = optax.adamw(1e-3, weight_decay=0.01)
    opt_state = tx.init(params)

    def train_step(params, opt_state, idx, targets):
        loss, grads = jax.value_and_grad(lambda p: ref.loss(p, config, idx, targets))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    step = jax.jit(train_step, donate_argnums=(0, 1))  # the fairest reference: no second copy of the state
    losses, times = [], []
    for idx, targets in _batches(config, B, T, steps):
        t0 = time.perf_counter()
        params, opt_state, loss = step(params, opt_state, idx, targets)
        losses.append(float(loss))
        times.append(time.perf_counter() - t0)
    steady = slice(1, None) if steps > 1 else slice(None)
    return dict(losses=losses, step_s=times, tokens_per_s=B * T * len(times[steady]) / sum(times[steady]),
                n_params=config.n_params(), vmhwm_mb=vmhwm_mb())


def run(spec: dict, timeout=900) -> dict:
    """Runs one configuration in a fresh process; returns its result (or the error)."""
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, __file__, "--worker", json.dumps(spec)], capture_output=True, text=True,
                          timeout=timeout)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or ["?"])[-1]
        return dict(error=tail[:300], wall_s=time.perf_counter() - started)
    result = json.loads(lines[-1][len("RESULT "):])
    result["wall_s"] = time.perf_counter() - started
    return result


def gpt2_config(n_layer, n_embd, n_head, vocab=50257, n_positions=1024, **tiles):
    return dict(n_layer=n_layer, n_embd=n_embd, n_head=n_head, vocab_size=vocab, n_positions=n_positions, **tiles)


def _log(*parts):
    print(*parts, flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="smaller models and fewer steps (a few minutes)")
    parser.add_argument("--budget-mb", type=int, default=None,
                        help="RSS budget for the capacity comparison (c) (default 2048, 1400 with --quick)")
    parser.add_argument("--limit-mb", type=int, default=None, help="memory limit for (a) and (b)")
    parser.add_argument("--swap-dir", default=tempfile.gettempdir())
    parser.add_argument("--capacity-limit-mb", type=int, default=None,
                        help=f"jnntile's memory limit in (c) (default: the budget - {CAPACITY_OVERHEAD_MB})")
    parser.add_argument("--skip-capacity", action="store_true")
    parser.add_argument("--disk-test-mb", type=int, default=1024,
                        help="size of the file that measures the disk's sequential bandwidth")
    args = parser.parse_args()
    if args.worker:
        spec = json.loads(args.worker)
        result = worker_jnntile(spec) if spec["kind"] == "jnntile" else worker_reference(spec)
        print("RESULT " + json.dumps(result), flush=True)
        return

    bench_started = time.perf_counter()

    swap_dir = tempfile.mkdtemp(prefix="jnntile-bench-", dir=args.swap_dir)
    if args.quick:
        B, T, limit, steps = 2, 64, args.limit_mb or 64, 4
        model = gpt2_config(4, 256, 4, vocab=32768, tile_embd=256, tile_vocab=4096)
    else:
        B, T, limit, steps = 4, 128, args.limit_mb or 256, 5
        model = gpt2_config(8, 512, 8)  # 51M parameters: 0.8 GB of parameters, gradients and AdamW state
    bandwidth = disk_bandwidth(swap_dir, args.disk_test_mb)
    _log(f"disk under {args.swap_dir}: sequential write {bandwidth[0]:.0f} MB/s, read {bandwidth[1]:.0f} MB/s "
         f"(direct I/O, {args.disk_test_mb} MB in 8 MB blocks)\n")
    overhead = table_ab(model, B, T, limit, steps, swap_dir, bandwidth)
    if not args.skip_capacity:
        capacity(args, overhead, swap_dir)
    _log(f"\nbench wall time {time.perf_counter() - bench_started:.0f} s")
    try:
        os.rmdir(swap_dir)
    except OSError:
        pass


def table_ab(model, B, T, limit, steps, swap_dir, bandwidth) -> float:
    """(a) and (b): one model with and without a limit; returns the fixed RSS overhead seen.

    `bandwidth`: the disk's sequential (write, read) MB/s, for the I/O floor of a step.
    """
    from jnntile import planning
    from jnntile.models.gpt2.config import GPT2Config
    from jnntile.core.runtime import SWAP_BACKENDS, RuntimeConfig

    plan = planning.plan(planning.StepSpec(GPT2Config(**model), B, T), workers=2)
    swap_mb = plan.swap_needed_mb(limit) + 256
    _log(f"(a, b) GPT-2 n_layer={model['n_layer']} n_embd={model['n_embd']} vocab={model['vocab_size']}: "
         f"{plan.n_params / 1e6:.1f}M parameters; parameters + gradients + AdamW = {plan.state / MB:.0f} MB "
         f"= {plan.state / MB / limit:.1f}x the {limit} MB limit; activations {plan.activations / MB:.0f} MB; "
         f"batch {B} x {T} tokens, {steps} steps (the first compiles and is left out of tokens/s and MB/step)")
    base = dict(kind="jnntile", config=model, batch=B, seq=T, steps=steps, swap_dir=swap_dir)
    default = RuntimeConfig.swap_backend
    runs = {"no limit": dict(base, limit_mb=16384)}
    for repeat in range(1, BACKEND_REPEATS + 1):  # alternating, so that a slow phase of the machine hits both
        for backend in sorted(SWAP_BACKENDS):
            runs[f"{limit} MB + swap, {backend} #{repeat}"] = dict(base, limit_mb=limit, swap_mb=swap_mb,
                                                                    swap_backend=backend)
    runs[f"{limit} MB + swap, {default}, no invalidation"] = dict(base, limit_mb=limit, swap_mb=swap_mb,
                                                                  release=False)
    if not plan.verdict(planning.Limits(limit // 2, swap_mb)).startswith("cannot"):
        runs[f"{limit // 2} MB + swap, {default}"] = dict(base, limit_mb=limit // 2, swap_mb=swap_mb)
    results = {}
    for name, spec in runs.items():
        results[name] = run(spec)
        _log(f"  ran {name!r} in {results[name]['wall_s']:.0f} s" +
             (f": {results[name]['error']}" if "error" in results[name] else ""))
    reference = results["no limit"]
    width = max(len(name) for name in runs)
    _log(f"\n{'run':<{width}} {'peak RSS':>8} {'limit':>6} {'RSS-limit':>9} {'StarPU':>7} {'planner':>8} "
         f"{'tokens/s':>8} {'x':>5} {'to swap':>8} {'from swap':>9}  losses")
    _log(f"{'':<{width}} {'MB':>8} {'MB':>6} {'MB':>9} {'peak MB':>7} {'peak MB':>8} {'':>8} {'':>5} {'MB/step':>8} "
         f"{'MB/step':>9}")
    overheads = []
    for name, r in results.items():
        if "error" in r:
            _log(f"{name:<{width}} failed: {r['error']}")
            continue
        spec = runs[name]
        limited = spec["limit_mb"] < 16384
        if name == "no limit":
            same = "reference"
        elif "losses" in reference:
            diff = max(abs(a - b) for a, b in zip(r["losses"], reference["losses"]))
            same = "identical" if diff == 0 else f"max diff {diff:.1e}"
        else:
            same = "?"
        if limited:
            overheads.append(r["vmhwm_mb"] - spec["limit_mb"])
        speed = r["tokens_per_s"] / reference["tokens_per_s"] if "tokens_per_s" in reference else float("nan")
        _log(f"{name:<{width}} {r['vmhwm_mb']:8.0f} {spec['limit_mb'] if limited else '-':>6} "
             f"{r['vmhwm_mb'] - spec['limit_mb'] if limited else float('nan'):9.0f} {r['starpu_peak_mb']:7.0f} "
             f"{r['plan_peak_mb']:8.0f} {r['tokens_per_s']:8.0f} {speed:5.2f} {r['written_mb']:8.1f} "
             f"{r['read_mb']:9.1f}  {same}")
    if "losses" in reference:
        _log(f"planner peak / StarPU's measured peak (no limit): {reference['plan_peak_mb']:.0f} / "
             f"{reference['starpu_peak_mb']:.0f} MB = {reference['plan_peak_mb'] / reference['starpu_peak_mb']:.2f}")
        _log(f"losses: {', '.join(f'{x:.6f}' for x in reference['losses'])}")
    overhead = max(overheads) if overheads else float("nan")
    _log(f"fixed overhead (peak RSS - limit, the most over the limited runs): {overhead:.0f} MB")
    io_table(results, runs, width, bandwidth)
    backend_summary(results, runs)
    return overhead


def backend_summary(results, runs):
    """Tokens/s, swap MB per step, peak RSS and page cache of each swap backend (median over its runs)."""
    import statistics

    by_backend = {}
    for name, r in results.items():
        if "error" not in r and runs[name].get("swap_backend"):
            by_backend.setdefault(runs[name]["swap_backend"], []).append(r)
    if len(by_backend) < 2:
        return
    _log(f"\nswap backends, median of {BACKEND_REPEATS} alternating runs each (this machine is shared: compare "
         "within this run):")
    medians = {}
    for backend, rs in sorted(by_backend.items()):
        median = {key: statistics.median(r[key] for r in rs)
                  for key in ("tokens_per_s", "written_mb", "read_mb", "vmhwm_mb", "page_cache_mb")}
        medians[backend] = median
        each = ", ".join(f"{r['tokens_per_s']:.0f}" for r in rs)
        _log(f"  {backend:<16} {median['tokens_per_s']:7.0f} tokens/s ({each}), "
             f"{median['written_mb']:.0f} MB to and {median['read_mb']:.0f} MB from swap per step, peak RSS "
             f"{median['vmhwm_mb']:.0f} MB, page cache of the swap {median['page_cache_mb']:.0f} MB")
    unistd, direct = medians.get("unistd"), medians.get("unistd_o_direct")
    if unistd and direct:
        _log(f"  unistd_o_direct / unistd tokens/s: {direct['tokens_per_s'] / unistd['tokens_per_s']:.2f}; RAM in "
             f"use (peak RSS + page cache): {direct['vmhwm_mb'] + direct['page_cache_mb']:.0f} vs "
             f"{unistd['vmhwm_mb'] + unistd['page_cache_mb']:.0f} MB")


def io_table(results, runs, width, bandwidth):
    """Per limited run: step time against the I/O floor, and the page cache the swap files hold."""
    write_bw, read_bw = bandwidth
    _log(f"\n{'run':<{width}} {'s/step':>7} {'I/O floor':>9} {'step /':>6} {'to+from':>8} {'page cache':>10}")
    _log(f"{'':<{width}} {'':>7} {'s/step':>9} {'floor':>6} {'MB/s':>8} {'MB':>10}")
    for name, r in results.items():
        if "error" in r or not runs[name].get("swap_mb"):
            continue
        step_s = sum(r["step_s"][1:]) / max(1, len(r["step_s"]) - 1)  # the first step compiles
        floor_s = r["written_mb"] / write_bw + r["read_mb"] / read_bw
        _log(f"{name:<{width}} {step_s:7.2f} {floor_s:9.2f} {step_s / floor_s if floor_s else float('nan'):6.1f} "
             f"{(r['written_mb'] + r['read_mb']) / step_s:8.0f} {r['page_cache_mb']:10.0f}")
    _log("I/O floor: a step's swap bytes at the disk's sequential bandwidth (StarPU moves one tile at a time, so "
         "this is a lower bound); page cache: the swap files' pages resident in RAM after the last step (RAM used "
         "beyond the process's RSS; none with direct I/O)")


def capacity(args, overhead, swap_dir):
    """(c): the largest reference GPT-2 under the budget vs a GPT-2 jnntile trains under it."""
    from jnntile import planning
    from jnntile.models.gpt2.config import GPT2Config

    budget, B, T = args.budget_mb or (1400 if args.quick else 2048), 1, 64
    _log(f"\n(c) capacity under a {budget} MB peak-RSS budget, batch {B} x {T} tokens, AdamW, vocab 50257")
    n_embd, n_head = 768, 12
    measured = {}

    def reference(n_layer):
        if n_layer not in measured:
            spec = dict(kind="reference", config=gpt2_config(n_layer, n_embd, n_head), batch=B, seq=T, steps=3)
            r = run(spec)
            if "error" in r:
                _log(f"  reference n_layer={n_layer}: failed: {r['error']}")
                return None
            measured[n_layer] = r
            _log(f"  reference n_layer={n_layer:2d} n_embd={n_embd}: {r['n_params'] / 1e6:6.1f}M parameters, "
                 f"peak RSS {r['vmhwm_mb']:5.0f} MB, {r['tokens_per_s']:5.0f} tokens/s")
        return measured[n_layer]

    low, high = reference(2), reference(8)
    if not (low and high):
        return
    per_param = (high["vmhwm_mb"] - low["vmhwm_mb"]) / (high["n_params"] - low["n_params"])
    fixed = low["vmhwm_mb"] - per_param * low["n_params"]
    layer_params = (high["n_params"] - low["n_params"]) / 6
    guess = int((budget - fixed) / per_param - (low["n_params"] - 2 * layer_params)) // int(layer_params)
    guess = max(1, min(guess, 48))
    _log(f"  fit: peak RSS ~ {fixed:.0f} MB + {per_param * MB:.1f} bytes/parameter; predicted largest: "
         f"n_layer={guess}")
    best = None
    for n_layer in (guess - 1, guess, guess + 1, guess + 2):  # bracket the prediction with measurements
        r = reference(n_layer) if n_layer >= 1 else None
        if r and r["vmhwm_mb"] <= budget and (best is None or r["n_params"] > best["n_params"]):
            best = r
    if best is None:
        _log("  the reference fits no measured size in the budget")
        return
    _log(f"  largest reference measured within {budget} MB: {best['n_params'] / 1e6:.1f}M parameters "
         f"(peak RSS {best['vmhwm_mb']:.0f} MB)")

    big = gpt2_config(48, 1600, 25) if not args.quick else gpt2_config(12, 768, 12)  # gpt2-xl / gpt2
    # jnntile's RSS beyond its limit grows with the model (the compiled step, Python
    # objects): ~330 MB for the 51M model of (a), ~550 MB for gpt2-xl.
    jn_limit = args.capacity_limit_mb or budget - CAPACITY_OVERHEAD_MB
    big_plan = planning.plan(planning.StepSpec(GPT2Config(**big), B, T), workers=2)
    spec = dict(kind="jnntile", config=big, batch=B, seq=T, steps=2, swap_dir=swap_dir, limit_mb=jn_limit,
                swap_mb=big_plan.swap_needed_mb(jn_limit) + 512)
    _log(f"  jnntile: GPT-2 n_layer={big['n_layer']} n_embd={big['n_embd']}, {big_plan.n_params / 1e6:.0f}M "
         f"parameters ({big_plan.state / MB:.0f} MB of parameters, gradients and AdamW state) under a {jn_limit} MB "
         f"limit with {spec['swap_mb']} MB of swap, {spec['steps']} steps ...")
    r = run(spec, timeout=1800)
    if "error" in r:
        _log(f"  jnntile failed: {r['error']}")
        return
    within = "within" if r["vmhwm_mb"] <= budget else "OVER"
    _log(f"  jnntile: peak RSS {r['vmhwm_mb']:.0f} MB ({within} the budget), losses "
         f"{', '.join(f'{x:.4f}' for x in r['losses'])}, step times {', '.join(f'{x:.0f}' for x in r['step_s'])} "
         f"s, {r['written_mb'] / 1024:.1f} GB to swap and {r['read_mb'] / 1024:.1f} GB from swap per step, "
         f"swap peak {r['disk_peak_mb'] / 1024:.1f} GB (planner peak {r['plan_peak_mb'] / 1024:.1f} GB), "
         f"init {r['init_s']:.0f} s")
    if r["vmhwm_mb"] <= budget:
        _log(f"  capacity ratio (parameters): {r['n_params'] / 1e6:.0f}M / {best['n_params'] / 1e6:.1f}M = "
             f"{r['n_params'] / best['n_params']:.1f}x")


if __name__ == "__main__":
    main()
