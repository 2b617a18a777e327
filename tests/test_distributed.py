"""Several processes training one model under mpirun (docs/distributed.md): 2 and 3 ranks against one process,
the training command with a memory limit and swap per rank and on fine-tuning examples, bad input, and ranks
that die or stop.

Each test launches Open MPI's mpirun with --oversubscribe (this machine may have fewer cores than ranks) and
one CPU worker per rank; models are tiny. They skip where jnntile has no StarPU-MPI or no mpirun is found.
"""

import argparse
import fcntl
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import assert_trained_params_close, rel_err

import distributed_worker
import jnntile
from jnntile.core import distributed
from jnntile.io import tensorfile
from jnntile.training import optim
from jnntile import data as data_mod
from jnntile import flags, memory
from jnntile import train as train_mod

MPIRUN = shutil.which("mpirun")
WORKER = Path(__file__).with_name("distributed_worker.py")


def _launcher_missing() -> str | None:
    if MPIRUN is None:
        return "no MPI launcher: mpirun is not on PATH (apt-get install openmpi-bin; `make test` installs it)"
    version = subprocess.run([MPIRUN, "--version"], capture_output=True, text=True).stdout
    if "Open MPI" not in version:
        return f"these tests pass Open MPI's options to mpirun, and {MPIRUN} is another MPI: {version[:60]!r}"
    return None


def _skip_reason() -> str | None:
    if not jnntile.runtime.HAS_MPI:
        return jnntile._xla_ffi.mpi_unavailable_reason()
    return _launcher_missing()


needs_mpirun = pytest.mark.skipif(_skip_reason() is not None, reason=str(_skip_reason()))


# Open MPI's transports between ranks as between machines: TCP, and `self` (a rank to itself), with the ob1
# point-to-point layer that uses them (UCX's layer would bring its own shared memory). vader, the shared-memory
# transport, is off. JNNTILE_TEST_TCP_ONLY=1 runs every test's job so.
TCP_ONLY = ["--mca", "pml", "ob1", "--mca", "btl", "tcp,self"]


def mpirun(*groups, timeout: float = 300, tcp_only: bool = os.environ.get("JNNTILE_TEST_TCP_ONLY") == "1",
           options=()) -> subprocess.CompletedProcess:
    """Runs each group `(n, *arguments)` as `python *arguments` on n ranks, all in one job (MPMD); a group
    `(n, {name: value}, *arguments)` with those environment variables. `options` go to mpirun."""
    argv = [MPIRUN, "--oversubscribe", "--bind-to", "none", *(TCP_ONLY if tcp_only else []), *options] + (
        ["--allow-run-as-root"] if os.geteuid() == 0 else [])
    for i, (count, *arguments) in enumerate(groups):
        env = [f"{k}={v}" for k, v in arguments.pop(0).items()] if arguments and isinstance(arguments[0], dict) else []
        argv += ([":"] if i else []) + ["-n", str(count), *(["env", *env] if env else []), sys.executable,
                                          *map(str, arguments)]
    # A session of its own: a hung job is killed whole, never left behind.
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True, cwd=Path(__file__).parent)
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        raise AssertionError(f"{' '.join(argv)} hung for {timeout} s") from None
    return subprocess.CompletedProcess(argv, process.returncode, out, err)


# ---- without mpirun ------------------------------------------------------------------------

def test_one_process_sums_nothing_and_splits_nothing():
    assert jnntile.runtime.world_size() == 1 and jnntile.runtime.rank() == 0
    batch = np.arange(12).reshape(6, 2)
    np.testing.assert_array_equal(distributed.local_rows(batch), batch)
    assert distributed.mean_and_any(2.5, True, "a value") == (2.5, True)
    tx = optim.allreduce_sum()
    grads = {"a": object()}
    assert tx.update(grads, tx.init(None))[0] is grads


def test_batch_rows_and_reduction_roots_of_the_default_ownership():
    ownership = distributed.DataParallel()
    assert [ownership.batch_rows(6, r, 3) for r in range(3)] == [slice(0, 2), slice(2, 4), slice(4, 6)]
    assert ownership.reduction_roots(5, 2) == [0, 1, 0, 1, 0]
    with pytest.raises(ValueError, match="a batch of 8 sequences cannot be split evenly across 3 ranks"):
        ownership.batch_rows(8, 0, 3)


@pytest.mark.skipif(jnntile.runtime.HAS_MPI, reason="this jnntile has StarPU-MPI")
def test_distributed_without_starpu_mpi_says_why(restore_runtime):
    jnntile.runtime.stop()
    with pytest.raises(ValueError, match="distributed=True: this jnntile .* without distributed training"):
        jnntile.runtime.configure(distributed=True)


@pytest.mark.skipif(jnntile.runtime.HAS_MPI or _launcher_missing() is not None,
                    reason=_launcher_missing() or "this jnntile has StarPU-MPI")
def test_a_build_without_starpu_mpi_says_so_under_mpirun(dataset, tmp_path):
    result = mpirun((2, "-m", "jnntile.train", "--data", dataset, "--out", tmp_path, "--steps", "1"))
    assert result.returncode == 2
    assert "error: 2 processes were launched to train one model, but this jnntile" in result.stderr, result.stderr


# ---- under mpirun --------------------------------------------------------------------------

STEPS = 4


@pytest.fixture(scope="module")
def one_process():
    """Losses and parameters of the worker's training on one process: the reference."""
    return distributed_worker.train(STEPS)


def _tile_bytes(params) -> int:
    """Bytes of every gradient tile of the worker's model (tiles are not padded without direct-I/O swap)."""
    return sum(4 * p.size for p in params.values())


@needs_mpirun
@pytest.mark.parametrize("ranks", [2, 3])
def test_ranks_train_like_one_process(ranks, one_process, tmp_path):
    result = mpirun((ranks, WORKER, tmp_path, "--steps", STEPS))
    assert result.returncode == 0, result.stderr[-3000:]
    runs = [np.load(tmp_path / f"rank{r}.npz") for r in range(ranks)]
    losses, params = one_process
    names = sorted(params)
    for r, run in enumerate(runs):
        for name in names:  # the same bits on every rank
            np.testing.assert_array_equal(run[f"param:{name}"], runs[0][f"param:{name}"], err_msg=f"rank {r}: {name}")
        np.testing.assert_array_equal(run["losses"], runs[0]["losses"])
    assert rel_err(runs[0]["losses"], losses) <= 1e-5, (runs[0]["losses"], losses)
    # The parameters to 1e-4 (the sum over ranks changes the rounding; the key biases to AdamW's bound).
    assert_trained_params_close({name: runs[0][f"param:{name}"] for name in names}, params, STEPS,
                                distributed_worker.LEARNING_RATE, 1e-4)
    # Every tile of a step: N-1 partial sums go up and N-1 copies of the sum come back.
    assert sum(int(run["sent"]) for run in runs) == 2 * (ranks - 1) * STEPS * _tile_bytes(params)
    for r, run in enumerate(runs):
        # DESIGN invariant 5: paused workers, and StarPU-MPI's thread asleep with no transfer in flight.
        assert run["idle_cpu_per_s"] < 0.2, f"rank {r} used {run['idle_cpu_per_s']:.2f} CPU-seconds per second idle"
        unsummed, twice = run["misuse_errors"]
        assert "chain jnntile.optim.allreduce_sum() before adamw" in unsummed
        assert "summed over the ranks already; chain it once" in twice


@needs_mpirun
@pytest.mark.parametrize("ranks, keep_fetched", [(2, False), (3, False), (4, False), (2, True)],
                         ids=["2", "3", "4", "2-kept"])
def test_ranks_with_sharded_state_train_like_one_process(ranks, keep_fetched, one_process, tmp_path):
    """Each tile of the parameters, their moments and summed gradients on one rank (docs/distributed.md,
    "Sharded state"): the losses and parameters of one process, every tile fetched for the ops that read it,
    or once a step when the ranks keep what they fetch until its owner writes it (shard_keep_fetched)."""
    result = mpirun((ranks, WORKER, tmp_path, "--steps", STEPS, "--shard-state",
                     *(["--keep-fetched"] if keep_fetched else [])))
    assert result.returncode == 0, result.stderr[-3000:]
    runs = [np.load(tmp_path / f"rank{r}.npz") for r in range(ranks)]
    losses, params = one_process
    names = sorted(params)
    for r, run in enumerate(runs):
        for name in names:  # read by every rank together: each tile from its owner
            np.testing.assert_array_equal(run[f"param:{name}"], runs[0][f"param:{name}"], err_msg=f"rank {r}: {name}")
        np.testing.assert_array_equal(run["losses"], runs[0]["losses"])
    assert rel_err(runs[0]["losses"], losses) <= 1e-5, (runs[0]["losses"], losses)
    assert_trained_params_close({name: runs[0][f"param:{name}"] for name in names}, params, STEPS,
                                distributed_worker.LEARNING_RATE, 1e-4)
    # Per step, every parameter tile goes from its owner to the N-1 other ranks for each op that reads it: at
    # least the forward and the backward of each of the 2 micro-batches (3 ops read the tied embedding); kept,
    # once. The gradient's partial sums go up once; the final reads of the parameters add one fetch of each.
    per_fetch = (ranks - 1) * _tile_bytes(params)
    sent = sum(int(run["sent"]) for run in runs) / per_fetch
    micro = distributed_worker.MICRO_BATCHES
    low, high = ((2 * STEPS, 2 * STEPS + 1) if keep_fetched else
                 ((2 * micro + 1) * STEPS, (3 * micro + 1) * STEPS + 1))
    assert low <= sent <= high * 1.01, sent


# The worker's state every rank's (data parallel) and sharded (each rank then also waits for parameter tiles).
STATES = pytest.mark.parametrize("state", [[], ["--shard-state"]], ids=["replicated", "sharded"])


@needs_mpirun
@STATES
def test_ranks_over_tcp_alone_train_like_one_process(state, one_process, tmp_path):
    """Shared memory off, as between machines (docs/distributed.md, "On several machines"): every transfer goes
    through TCP, and the ranks give one process's losses."""
    result = mpirun((2, WORKER, tmp_path, "--steps", STEPS, *state), tcp_only=True,
                    options=["--mca", "btl_base_verbose", "10"])
    assert result.returncode == 0, result.stderr[-3000:]
    # Open MPI names the transport each rank uses to the other: TCP, not vader (shared memory).
    said = result.stdout + result.stderr
    assert said.count("Using tcp btl for send to") == 2 and "Using vader" not in said, said[-3000:]
    for r in range(2):
        assert rel_err(np.load(tmp_path / f"rank{r}.npz")["losses"], one_process[0]) <= 1e-5


SMALL = ["--n-layer", "1", "--n-head", "2", "--n-embd", "32", "--seq-len", "32", "--eval-batches", "1",
         "--quiet", "--steps", "3", "--eval-interval", "3", "--workers", "1"]


def _losses(out):
    return [json.loads(line)["loss"] for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]


@needs_mpirun
@pytest.mark.parametrize("state", [[], ["--shard-state", "--remat", "block"]], ids=["replicated", "sharded-remat"])
def test_command_with_a_memory_limit_and_swap_per_rank(state, dataset, tmp_path):
    """Each rank under its own limit with its own swap; sharded, with every block recomputed besides (a
    recomputed forward fetches its parameters again)."""
    common = ["--data", str(dataset), *SMALL, "--batch-size", "4", "--samples", "1", "--sample-tokens", "4"]
    train_mod.train(train_mod.parse_args([*common, "--out", str(tmp_path / "one")]))
    swap = tmp_path / "swap"
    result = mpirun((2, "-m", "jnntile.train", *common, *state, "--out", tmp_path / "two", "--memory-limit-mb", "3",
                     "--swap-dir", swap, "--swap-size-mb", "64"))
    assert result.returncode == 0, result.stderr[-3000:]
    rows = {run: [json.loads(line) for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
            for run in ("one", "two")}
    assert rel_err([r["loss"] for r in rows["two"]], [r["loss"] for r in rows["one"]]) <= 1e-5
    assert rows["two"][-1]["val_loss"] == pytest.approx(rows["one"][-1]["val_loss"], rel=1e-5)
    # Rank 0 alone prints and writes; every rank trained on its half of each batch under its own limit and swap.
    assert result.stdout.count("(tiny); tiles") == 1 and result.stdout.count("--- sample 0 ---") == 1
    assert "batch 4 x 32 (2 per rank)" in result.stdout and "rank 0 of 2 (StarPU-MPI" in result.stdout
    assert "memory limit 3 MB, swap 64 MB in" in result.stdout
    assert (tmp_path / "two" / "latest").read_text() == "ckpt-0000003"
    assert not any(swap.iterdir()), "every rank removed its swap files"


HF_LLAMA = Path(__file__).parent / "data" / "hf_tiny_llama"
# A step of 2 micro-batches of 6 packed rows, which 2 and 3 ranks split.
ON_CHATS = ["--init-from-hf", str(HF_LLAMA), "--batch-size", "6", "--grad-accum-steps", "2", "--seq-len", "64",
            "--packing", "on", "--steps", "3", "--eval-interval", "3", "--eval-batches", "2", "--samples", "0",
            "--workers", "1", "--quiet"]


def _conversation(i: int) -> dict:
    """A chat of 1 or 2 turns, questions of 1 to 9 words, replies of 1 to 6 (29 to 101 tokens with the template's
    markup, 2 to 18 of them targets): packed rows hold uneven numbers of targets, some few among many masked
    tokens (issue 49)."""
    turns = []
    for t in range(1 + (i % 4 == 0)):
        turns += [{"role": "user", "content": " ".join("q" * (1 + (5 * i + t) % 9))},
                  {"role": "assistant", "content": " ".join("a" * (1 + (7 * i + 3 * t) % 6))}]
    return {"messages": turns}


@pytest.fixture(scope="module")
def chats(tmp_path_factory):
    """A dataset of conversations of uneven lengths for the Llama fixture, and one process's losses on it."""
    folder = tmp_path_factory.mktemp("chats")
    (folder / "chats.jsonl").write_text("".join(json.dumps(_conversation(i)) + "\n" for i in range(90)))
    data_mod.main([str(folder / "chats.jsonl"), "--tokenizer", str(HF_LLAMA), "--out", str(folder / "data")])
    train_mod.train(train_mod.parse_args([*ON_CHATS, "--data", str(folder / "data"), "--out", str(folder / "one")]))
    return folder


@needs_mpirun
@pytest.mark.parametrize("ranks", [2, 3])
def test_ranks_fine_tuning_on_examples_give_the_losses_of_one_process(ranks, chats, tmp_path):
    # Each rank's rows hold their own number of targets: the step's mean is over the targets of all ranks'
    # micro-batches, not a mean of the ranks' (or micro-batches') means.
    result = mpirun((ranks, "-m", "jnntile.train", *ON_CHATS, "--data", chats / "data", "--out", tmp_path))
    assert result.returncode == 0, result.stderr[-3000:]
    rows = {run: [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
            for run, out in (("one", chats / "one"), ("ranks", tmp_path))}
    losses = {run: [r["loss"] for r in rows[run]] for run in rows}
    assert rel_err(losses["ranks"], losses["one"]) <= 1e-5, losses
    # Validation too: each batch's mean over its targets, not the mean of the ranks' means.
    assert rows["ranks"][-1]["val_loss"] == pytest.approx(rows["one"][-1]["val_loss"], rel=1e-5)


@needs_mpirun
def test_sharded_state_is_planned_per_rank_as_the_planner_plans_it(dataset, tmp_path):
    # 0.4M parameters, 6.8 MB of state, half of it on each rank: train refuses a 3 MB limit without swap either
    # way, with the verdict `python -m jnntile.memory --ranks 2` plans (the dataset's vocabulary: 300).
    shape = ["--n-layer", "2", "--n-head", "2", "--n-embd", "128", "--seq-len", "32", "--batch-size", "2",
             "--workers", "1", "--memory-limit-mb", "3"]
    parser = argparse.ArgumentParser()
    memory.add_arguments(parser)
    refusals = {}
    for sharded in ([], ["--shard-state"]):
        result = mpirun((2, "-m", "jnntile.train", "--data", dataset, *shape, *sharded, "--out", tmp_path))
        assert result.returncode == 2, result.stderr[-3000:]
        args = parser.parse_args([*shape, "--vocab-size", "300", "--ranks", "2", *sharded])
        with pytest.raises(ValueError) as planned:
            memory.plan_from_args(args).check(flags.limits(args))
        assert result.stderr.count(f"error: {planned.value}") == 2, (result.stderr[-3000:], planned.value)
        refusals[bool(sharded)] = str(planned.value)
    assert "(peak 4 MB)" in refusals[True] and "(peak 7 MB)" in refusals[False]
    assert not (tmp_path / "metrics.jsonl").exists()


@needs_mpirun
def test_batch_that_the_ranks_cannot_split_is_refused_by_every_rank(dataset, tmp_path):
    result = mpirun((3, "-m", "jnntile.train", "--data", dataset, *SMALL, "--batch-size", "4", "--out", tmp_path))
    assert result.returncode == 2
    message = "error: a batch of 4 sequences cannot be split evenly across 3 ranks"
    assert result.stderr.count(message) == 3, result.stderr[-3000:]
    assert not (tmp_path / "metrics.jsonl").exists()


@needs_mpirun
def test_ranks_with_different_settings_are_refused(dataset, tmp_path):
    command = ["-m", "jnntile.train", "--data", dataset, *SMALL, "--batch-size", "2", "--out", tmp_path]
    result = mpirun((1, *command), (1, *command, "--lr", "0.1", "--tile-embd", "16"))
    assert result.returncode == 2
    message = "error: the training set-up differs across ranks: --lr is 0.003 on rank 0; 0.1 on rank 1. --tile-embd"
    assert result.stderr.count(message) == 2, result.stderr[-3000:]
    assert not (tmp_path / "metrics.jsonl").exists()


@needs_mpirun
@STATES
def test_a_rank_that_dies_ends_the_run(state, tmp_path):
    result = mpirun((2, WORKER, tmp_path, "--signal", "KILL", "--at-step", "2", "--on-rank", "1", *state))
    assert result.returncode != 0
    assert "rank 1" in result.stderr and "signal 9" in result.stderr, result.stderr[-3000:]


@needs_mpirun
@STATES
def test_a_rank_that_stops_is_named_by_the_others_within_the_watchdog_time(state, tmp_path):
    result = mpirun((3, WORKER, tmp_path, "--signal", "STOP", "--at-step", "2", "--on-rank", "1", "--watchdog-s", "3",
                     *state), timeout=120)
    assert result.returncode != 0
    # Ranks 0 and 2 wait for tiles from rank 1, and for each other's sums, which wait for rank 1: a ping tells.
    # Whichever of them reports first exits, and mpirun, ending the job, resumes rank 1 (SIGCONT before its
    # SIGTERM): the other may then find it answering. So at least one names it, and none names another rank.
    assert result.stderr.count("rank 1 does not answer: died or stopped") >= 1, result.stderr[-3000:]
    # After the watchdog's 3 s, whether a rank waited for tiles or, its step done, for the others' losses.
    waits = re.findall(r"(?:no StarPU task completed for|waited) (\d+\.\d) s[^\n]*rank 1 does not answer",
                       result.stderr)
    assert waits and all(3 <= float(s) < 6 for s in waits), result.stderr[-3000:]
    assert not re.search(r"rank [02] does not answer|ranks .* do not answer", result.stderr), result.stderr[-3000:]


# ---- --shard-state: the command and its checkpoints ------------------------------------------

# Tensors of several tiles (chunks of tiles of both ranks' shards), a batch that 2 and 3 ranks split.
SHARDED = [*SMALL, "--batch-size", "6", "--tile-embd", "16", "--tile-vocab", "128", "--samples", "0"]


def test_shard_state_on_one_process_is_refused_naming_why(dataset, tmp_path, capsys):
    assert train_mod.main(["--data", str(dataset), *SHARDED, "--out", str(tmp_path), "--shard-state"]) == 2
    assert ("error: --shard-state shards the state across the ranks of an mpirun; with one process there is nothing "
            "to shard: run it under mpirun -n N (N > 1), or leave --shard-state out") in capsys.readouterr().err
    assert not (tmp_path / "metrics.jsonl").exists()


@needs_mpirun
def test_sharded_llama_in_bfloat16_on_three_ranks_gives_the_losses_of_one_process(dataset, tmp_path):
    common = ["--data", str(dataset), *SHARDED, "--model", "llama-tiny", "--dtype", "bfloat16"]
    train_mod.train(train_mod.parse_args([*common, "--out", str(tmp_path / "one")]))
    # The samples' reads of the weights are every rank's (collective); rank 0 alone prints.
    result = mpirun((3, "-m", "jnntile.train", *common, "--out", tmp_path / "three", "--shard-state", "--samples",
                     "1", "--sample-tokens", "4"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert rel_err(_losses(tmp_path / "three"), _losses(tmp_path / "one")) <= 1e-5
    assert result.stdout.count("done: 3 steps") == 1 and result.stdout.count("--- sample 0 ---") == 1


@needs_mpirun
def test_sharded_lora_on_two_ranks_gives_the_losses_of_one_process(dataset, tmp_path):
    """The frozen base and the adapters sharded alike; the adapters are made in the same order in every process
    (they once came from a set of names, whose order differs from process to process: the ranks' transfer tags
    then differed and StarPU-MPI aborted with MPI_ERR_TRUNCATE or waited forever)."""
    common = ["--data", str(dataset), *SHARDED, "--lora-rank", "4", "--lora-targets", "all-linear"]
    train_mod.train(train_mod.parse_args([*common, "--out", str(tmp_path / "one")]))
    command = ["-m", "jnntile.train", *common, "--out", tmp_path / "two", "--shard-state"]
    result = mpirun((1, {"PYTHONHASHSEED": "1"}, *command), (1, {"PYTHONHASHSEED": "2"}, *command))
    assert result.returncode == 0, result.stderr[-3000:]
    assert rel_err(_losses(tmp_path / "two"), _losses(tmp_path / "one")) <= 1e-5


SHARDS_IN_ANOTHER_ORDER = """
import jnntile
from jnntile.core import distributed
from jnntile.ops import values
jnntile.runtime.start(distributed=True, shard_state=True, workers=1)
shapes = [(4, 4), (8, 4)][::1 if jnntile.runtime.rank() == 0 else -1]
try:
    with distributed.sharded_state():
        tensors = [values.zeros(shape, tile_shape=(4, 4)) for shape in shapes]
except distributed.SetUpError as e:
    print("refused:", e)
"""


@needs_mpirun
def test_ranks_that_shard_other_tensors_are_refused_before_anything_is_sent():
    result = mpirun((2, "-c", SHARDS_IN_ANOTHER_ORDER))
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("refused: the tensors sharded differs across ranks: count is") == 0
    assert result.stdout.count("refused: the tensors sharded differs across ranks: layout is") == 2, result.stdout


def _resumable_from(out, step: int, to):
    """A copy of run `out` whose latest checkpoint is that of `step`, as if the run had stopped there."""
    shutil.copytree(out, to, ignore=shutil.ignore_patterns(".lock"))
    for later in (p for p in to.glob("ckpt-*") if p.name > f"ckpt-{step:07d}"):
        shutil.rmtree(later)
    (to / "latest").write_text(f"ckpt-{step:07d}")
    return to


@needs_mpirun
def test_checkpoint_of_sharded_ranks_resumes_on_one_process_and_on_three_sharded_ranks(dataset, tmp_path):
    """Every rank writes its own tiles of each checkpoint (and export) into the files one process writes, which
    one process and 3 sharded ranks resume with the losses of the uninterrupted run."""
    common = ["--data", str(dataset), *SHARDED, "--steps", "4", "--grad-accum-steps", "2", "--checkpoint-interval",
              "2"]
    train_mod.train(train_mod.parse_args([*common, "--out", str(tmp_path / "one")]))
    result = mpirun((2, "-m", "jnntile.train", *common, "--out", tmp_path / "two", "--shard-state", "--export-hf",
                     tmp_path / "export"))
    assert result.returncode == 0, result.stderr[-3000:]
    reference = _losses(tmp_path / "one")
    assert rel_err(_losses(tmp_path / "two"), reference) <= 1e-5
    assert sorted(p.name for p in (tmp_path / "two").iterdir()) == [
        ".lock", "ckpt-0000002", "ckpt-0000004", "latest", "loss.png", "metrics.jsonl"]  # no temporaries left
    # The export is the final checkpoint's weights, bit for bit, in the layout one process writes.
    exported = tensorfile.SafetensorsFile(tmp_path / "export" / "model.safetensors")
    saved = tensorfile.SafetensorsFile(tmp_path / "two" / "ckpt-0000004" / "model.safetensors")
    assert list(exported) == list(saved)
    for name in saved:
        np.testing.assert_array_equal(exported[name].read(), saved[name].read(), err_msg=name)

    alone = _resumable_from(tmp_path / "two", 2, tmp_path / "alone")
    train_mod.train(train_mod.parse_args([*common, "--out", str(alone), "--resume"]))
    three = _resumable_from(tmp_path / "two", 2, tmp_path / "three")
    result = mpirun((3, "-m", "jnntile.train", *common, "--out", three, "--resume", "--shard-state"))
    assert result.returncode == 0, result.stderr[-3000:]
    for run in (alone, three):
        assert len(_losses(run)) == 4 and rel_err(_losses(run), reference) <= 1e-5, run


# `python -m jnntile.train` that kills itself (SIGKILL) as it begins step AT (0-based), or as it begins writing
# the optimizer state of checkpoint AT: `python -c DIES_AT step|checkpoint AT FLAGS...`.
DIES_AT = """
import os, signal, sys
from jnntile import train
from jnntile.io import tensorfile
where, at = sys.argv.pop(1), int(sys.argv.pop(1))
step_batch, write_file = train._step_batch, tensorfile.write_file
def dies_at_step(dataset, step, args, **fields):
    if where == "step" and step == at:
        os.kill(os.getpid(), signal.SIGKILL)
    return step_batch(dataset, step, args, **fields)
optimizer_state = (f".ckpt-{at:07d}.tmp-shared", "optimizer.safetensors")  # in the shared temporary
def dies_in_checkpoint(path, *args, **kwargs):
    if where == "checkpoint" and (path.parent.name, path.name) == optimizer_state:
        os.kill(os.getpid(), signal.SIGKILL)
    return write_file(path, *args, **kwargs)
train._step_batch, tensorfile.write_file = dies_at_step, dies_in_checkpoint
sys.exit(train.main(sys.argv[1:]))
"""


def _wait_until_unlocked(out: Path, timeout: float = 60) -> None:
    """mpirun may return before a rank it ended has exited, which then still holds the lock of --out (and the
    next run there is refused, naming its PID): waits until no process holds it."""
    deadline = time.monotonic() + timeout
    with open(out / ".lock") as lock:
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                assert time.monotonic() < deadline, f"{out} is still locked {timeout} s after mpirun ended"
                time.sleep(0.2)


@needs_mpirun
@pytest.mark.parametrize("where, at", [("step", 3), ("checkpoint", 4)])
def test_a_sharded_rank_that_dies_leaves_the_last_checkpoint_resumable(where, at, dataset, tmp_path):
    """Rank 1 of 2 sharded ranks killed mid-step, or while every rank writes its tiles of a checkpoint: the job
    ends, and the last complete checkpoint (step 2) resumes on one process with the uninterrupted losses."""
    common = ["--data", str(dataset), *SHARDED, "--steps", "6", "--checkpoint-interval", "2"]
    train_mod.train(train_mod.parse_args([*common, "--out", str(tmp_path / "one")]))
    out = tmp_path / "two"
    result = mpirun((1, "-m", "jnntile.train", *common, "--out", out, "--shard-state"),
                    (1, "-c", DIES_AT, where, at, *common, "--out", out, "--shard-state"))
    assert result.returncode != 0 and "signal 9" in result.stderr, result.stderr[-3000:]
    assert len(_losses(out)) == at  # the steps done before rank 1 died
    assert (out / "latest").read_text() == "ckpt-0000002" and (out / "ckpt-0000002" / "state.json").exists()
    _wait_until_unlocked(out)
    train_mod.train(train_mod.parse_args([*common, "--out", str(out), "--resume"]))
    assert rel_err(_losses(out), _losses(tmp_path / "one")) <= 1e-5
    assert sorted(p.name for p in out.glob("ckpt-*")) == ["ckpt-0000004", "ckpt-0000006"]
    assert not list(out.glob(".ckpt-*")), "the resumed run removed what the killed write left"


@needs_mpirun
def test_sharded_ranks_with_other_export_dtypes_are_refused(dataset, tmp_path):
    # Every rank writes its own tiles into the export's files: ranks writing other dtypes would mix them.
    common = ["-m", "jnntile.train", "--data", dataset, *SHARDED, "--out", tmp_path, "--shard-state", "--export-hf",
              tmp_path / "export"]
    result = mpirun((1, *common, "--export-dtype", "float32"), (1, *common, "--export-dtype", "bfloat16"))
    assert result.returncode == 2
    assert "--export-dtype is \"float32\" on rank 0; \"bfloat16\" on rank 1" in result.stderr, result.stderr[-3000:]
    assert not (tmp_path / "export").exists()


@needs_mpirun
def test_sharded_ranks_refuse_an_out_that_is_not_one_directory(dataset, tmp_path):
    # Every rank writes its tiles of each checkpoint into --out: refused before training, not at the first save.
    common = ["-m", "jnntile.train", "--data", dataset, *SHARDED, "--shard-state"]
    result = mpirun((1, *common, "--out", tmp_path / "a"), (1, *common, "--out", tmp_path / "b"))
    assert result.returncode == 2
    for out in "ab":  # each rank says it, naming its own
        assert (f"error: --out {tmp_path / out} is not one directory that every rank sees (rank 0's "
                "lock file, .lock, is not there on every rank): with --shard-state every rank writes its tiles of "
                "each checkpoint into it") in result.stderr, result.stderr[-3000:]
    assert not (tmp_path / "a" / "metrics.jsonl").exists()
