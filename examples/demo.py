"""The orbit_pt demo: a 2-rank FSDP2 fine-tune is preempted, resumes, and ends exactly where an
uninterrupted run ends.

    python3 dev.py demo                 # or: .venv/bin/python examples/demo.py [--dir DIR]

On CPU, in about a minute, with nothing downloaded:

1. run A: ``examples/finetune_fsdp.py`` on 2 gloo ranks; partway through, a real SIGTERM is sent
   to rank 1 alone. Both ranks agree on the preemption, save the same step, and exit 0.
2. run A is started again: it resumes from the preemption step and trains to the end.
3. run B: the same job, never interrupted.
4. the report: the steps saved and kept, the step A resumed from, and whether A's final weights
   and per-step losses are bitwise equal to B's. A PNG of both loss curves is written when
   matplotlib is installed.

The ranks are started the way ``torchrun --nproc_per_node 2`` starts them (RANK, WORLD_SIZE,
MASTER_ADDR, ... in the environment, one thread each), but by this script, so that it knows each
rank's process id and can signal one of them.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from orbit_pt import CheckpointManager, CheckpointManagerOptions

EXAMPLES = Path(__file__).resolve().parent
FINETUNE = EXAMPLES / "finetune_fsdp.py"


def launch_ranks(
    world_size: int,
    command: Sequence[str],
    *,
    log: Path | None = None,
    env: dict[str, str] | None = None,
) -> list[subprocess.Popen[bytes]]:
    """Start ``command`` (a python script and its arguments) once per rank, as torchrun would.

    Args:
        world_size: the number of ranks.
        command: what follows ``python`` on each rank's command line.
        log: a file that receives every rank's output (default: this process's output).
        env: extra environment variables for every rank.

    Returns:
        The rank processes, rank 0 first.
    """
    port = _free_port()
    out = log.open("ab") if log is not None else None
    procs = []
    for rank in range(world_size):
        rank_env = {
            **os.environ,
            **(env or {}),
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(world_size),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",  # as torchrun sets it: the ranks share the cores
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, *command], env=rank_env, stdout=out, stderr=subprocess.STDOUT
            )
        )
    if out is not None:
        out.close()  # the children hold their own copies
    return procs


def read_log(path: Path) -> list[dict[str, Any]]:
    """The records of a losses.jsonl file (a torn last line, from a killed writer, is skipped)."""
    if not path.exists():
        return []
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def losses_by_step(records: list[dict[str, Any]]) -> dict[int, str]:
    """Step -> loss (as ``float.hex``, exact) of the last time each step was trained."""
    return {r["step"]: r["loss_hex"] for r in records if r["event"] == "step"}


def wait_all(procs: Sequence[subprocess.Popen[bytes]], timeout: float = 300.0) -> list[int]:
    """Every process's exit code, killing any still running after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    codes = []
    for proc in procs:
        try:
            codes.append(proc.wait(timeout=max(0.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            proc.kill()
            codes.append(proc.wait())
    return codes


def final_weights(checkpoints: Path) -> tuple[int, dict[str, torch.Tensor]]:
    """The latest step of a checkpoint root and its model weights, read with orbit_pt."""
    with CheckpointManager(checkpoints, options=CheckpointManagerOptions(read_only=True)) as mgr:
        step = mgr.latest_step()
        if step is None:
            raise SystemExit(f"no committed step under {checkpoints}")
        return step, mgr.restore(step, ["model"])["model"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run(
    name: str, out: Path, job: list[str], steps: int, *, sigterm_after: int | None = None
) -> float:
    """One launch of the 2-rank job; optionally SIGTERM rank 1 once rank 0 logged a step."""
    started = time.monotonic()
    procs = launch_ranks(2, [str(FINETUNE), *job], log=out / f"{name}.log")
    tty = sys.stdout.isatty()
    sent = False
    try:
        while any(p.poll() is None for p in procs):
            if time.monotonic() - started > 600:
                raise TimeoutError(f"{name} ran for 10 minutes; see {out / f'{name}.log'}")
            logged = [r["step"] for r in read_log(out / "losses.jsonl") if r["event"] == "step"]
            last = logged[-1] if logged else None
            if (
                sigterm_after is not None
                and not sent
                and last is not None
                and last >= sigterm_after
            ):
                os.kill(procs[1].pid, signal.SIGTERM)
                sent = True
                carriage = "\r" if tty else ""
                print(f"{carriage}   sent SIGTERM to rank 1 (pid {procs[1].pid}) after step {last}")
            elif tty and last is not None:
                print(f"\r   step {last}/{steps - 1}", end="", flush=True)
            time.sleep(0.05)
    except BaseException:  # Ctrl-C or a timeout: leave no rank behind
        for proc in procs:
            proc.kill()
        raise
    codes = wait_all(procs, timeout=60)
    if tty:
        print("\r" + " " * 40 + "\r", end="")
    if any(codes):
        print((out / f"{name}.log").read_text(errors="replace")[-3000:])
        raise SystemExit(f"{name}: the ranks exited with {codes}; see {out / f'{name}.log'}")
    return time.monotonic() - started


def _loads_in_transformers(checkpoints: Path, step: int) -> str:
    """Whether transformers' Llama loads the step's model folder and computes the same logits."""
    try:
        import transformers
    except ImportError:
        return "(transformers is not installed)"
    from tiny_llama import TinyLlama

    with CheckpointManager(checkpoints, options=CheckpointManagerOptions(read_only=True)) as mgr:
        folder = mgr.step_dir(step) / "model"
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    ids = torch.tensor([list(b"The Fox and the Grapes")])
    with torch.no_grad():
        theirs = transformers.LlamaForCausalLM.from_pretrained(folder)(ids).logits
        ours = TinyLlama.from_pretrained(folder)(ids)
    same = torch.allclose(theirs, ours, rtol=1e-5, atol=1e-5)
    return f"LlamaForCausalLM.from_pretrained: {'same logits' if same else 'DIFFERENT logits'}"


def _plot(a: dict[int, float], b: dict[int, float], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(list(b), list(b.values()), label="B: uninterrupted", linewidth=3, alpha=0.5)
    ax.plot(list(a), list(a.values()), "--", label="A: preempted and resumed")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument(
        "--dir", type=Path, default=None, help="output folder (default: a temp dir)"
    )
    parser.add_argument("--steps", type=int, default=80, help="training steps of each run")
    parser.add_argument(
        "--interrupt-after", type=int, default=35, help="send SIGTERM once this step is logged"
    )
    parser.add_argument("--save-every", type=int, default=10, help="the job's --save-every")
    parser.add_argument("--keep-last-n", type=int, default=2, help="the job's --keep-last-n")
    parser.add_argument(
        "--keep-every-k-steps", type=int, default=40, help="the job's --keep-every-k-steps"
    )
    args = parser.parse_args()
    if not 0 <= args.interrupt_after < args.steps - 1:
        parser.error("--interrupt-after must be a step before the last one")
    root = args.dir or Path(tempfile.mkdtemp(prefix="orbit_pt-demo-"))
    job = [
        f"--steps={args.steps}",
        f"--save-every={args.save_every}",
        f"--keep-last-n={args.keep_last_n}",
        f"--keep-every-k-steps={args.keep_every_k_steps}",
        "--async-save",
        "--device=cpu",
    ]
    run_a, run_b = root / "A-preempted", root / "B-uninterrupted"
    for folder in (run_a, run_b):
        if folder.exists():
            raise SystemExit(f"{folder} exists from an earlier demo; pass another --dir")
        folder.mkdir(parents=True)
    print("orbit_pt demo: full fine-tuning of a small Llama on Aesop's fables under FSDP2,")
    print(f"2 ranks on CPU (gloo), {args.steps} steps, async saves every {args.save_every} steps\n")
    total = time.monotonic()

    print("1. run A, preempted partway")
    took = _run(
        "A1", run_a, [*job, f"--out={run_a}"], args.steps, sigterm_after=args.interrupt_after
    )
    end = [r for r in read_log(run_a / "losses.jsonl") if r["event"] == "end"][-1]
    if not end["preempted"]:
        raise SystemExit(
            "run A finished before the SIGTERM arrived; use a smaller --interrupt-after"
        )
    stopped = end["step"]
    print(f"   both ranks saved step {stopped} and exited 0 ({took:.1f} s); kept: {end['kept']}")

    print("2. run A started again")
    took = _run("A2", run_a, [*job, f"--out={run_a}"], args.steps)
    log_a = read_log(run_a / "losses.jsonl")
    resumed_from = [r for r in log_a if r["event"] == "start"][-1]["resumed_from"]
    print(f"   resumed from step {resumed_from}, trained to step {args.steps - 1} ({took:.1f} s)")

    print("3. run B, the same job uninterrupted")
    took = _run("B", run_b, [*job, f"--out={run_b}"], args.steps)
    log_b = read_log(run_b / "losses.jsonl")
    print(f"   trained steps 0..{args.steps - 1} ({took:.1f} s)")

    step_a, weights_a = final_weights(run_a / "checkpoints")
    step_b, weights_b = final_weights(run_b / "checkpoints")
    same_weights = step_a == step_b and weights_a.keys() == weights_b.keys()
    same_weights = same_weights and all(torch.equal(weights_a[k], weights_b[k]) for k in weights_a)
    losses_a, losses_b = losses_by_step(log_a), losses_by_step(log_b)
    same_losses = losses_a == losses_b and len(losses_b) == args.steps
    curve_a = {s: float.fromhex(h) for s, h in sorted(losses_a.items())}
    curve_b = {s: float.fromhex(h) for s, h in sorted(losses_b.items())}
    png = root / "losses.png"
    plotted = _plot(curve_a, curve_b, png)

    def saved(log: list[dict[str, Any]]) -> str:
        return " ".join(str(r["step"]) for r in log if r["event"] == "save")

    kept_a = [r for r in log_a if r["event"] == "end"][-1]["kept"]
    kept_b = [r for r in log_b if r["event"] == "end"][-1]["kept"]
    first, last = curve_b[0], curve_b[args.steps - 1]
    print(f"\nreport ({time.monotonic() - total:.0f} s in all)")
    print(f"  steps saved      A: {saved(log_a)}\n                   B: {saved(log_b)}")
    print(f"  steps kept       A: {kept_a}\n                   B: {kept_b}")
    print(
        f"  preempted at     step {stopped} (SIGTERM to rank 1 after step {args.interrupt_after})"
    )
    print(f"  resumed from     step {resumed_from}")
    print(
        f"  final weights    {'bitwise equal' if same_weights else 'DIFFERENT'} "
        f"(step {step_a} of A vs step {step_b} of B, {len(weights_b)} tensors)"
    )
    print(
        f"  loss curve       {'bitwise equal' if same_losses else 'DIFFERENT'} "
        f"({len(losses_b)} steps, loss {first:.3f} -> {last:.3f})"
    )
    print(f"  HF folder        {_loads_in_transformers(run_a / 'checkpoints', step_a)}")
    print(f"  plot             {png if plotted else '(pip install matplotlib for a PNG)'}")
    print(f"  everything is under {root}")
    if not (same_weights and same_losses):
        raise SystemExit("the resumed run drifted from the uninterrupted one")


if __name__ == "__main__":
    main()
