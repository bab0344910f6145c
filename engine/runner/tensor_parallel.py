"""Tensor parallelism across processes: rank 0 is the engine, ranks 1..N-1 are workers that hold
their share of the model (model/parallel.py) and a KV pool of the same block ids over their KV
heads, and run every forward pass rank 0 runs, in lockstep.

Rank 0 (`Leader`) schedules, samples and owns the block manager as with one process. Before each
forward pass it broadcasts what the pass needs (a header of sizes and facts, the step's packed
ints: ids, positions, slots, lengths, query starts, and the block tables), then runs its share;
the collectives inside the model (the layers' all-reduces, the embedding's all-reduce, the
logits' gather, which every rank runs on every sequence's last token, and then on the prompt
positions of a step that computes prompt logprobs, whose token indices the header counts and rank 0
sends after the tables) keep the ranks in step.
Workers (`worker_main`) loop on that
header. Besides FORWARD the header carries NEW_CACHE (build a KV pool of n blocks and a runner
over it: KV sizing and the real pool), CALIBRATE (the int8 smoothing pass, whose forward is
collective too), CAPTURE and STOP.

CUDA graphs: on CAPTURE every rank captures its decode graphs, bucket by bucket in the same order,
with the layers' NCCL all-reduces and the logits' all-gather inside them (torch.distributed's NCCL
collectives are capturable; they run when the graphs replay). A FORWARD header then names the
bucket whose graph rank 0 replays (0: an eager step), and a worker receives the step's packed ints
and block tables straight into the device buffers its own graph of that bucket reads, and replays
it: the ranks' graphs meet in the same collectives in the same order.

Process groups come from torch.distributed: gloo on the CPU, NCCL on CUDA (rank r on device
index base + r), rendezvous through a TCPStore that rank 0 binds on a free loopback port. The
group's timeout is long (workers wait for the next step while the server is idle); a dead worker
breaks the next collective at once, and a hung one stalls rank 0's step until the server's step
watchdog ends the engine. Any failed step under tensor parallelism ends the engine: the ranks can
no longer be trusted to agree.

Workers are started like the engine process (`python -c BOOT`, the parent's sys.path) and bound to
it: they exit when it does (a parent-pid watcher; not PDEATHSIG, which would fire when the thread
that started them ends, and the engine may be built on a short-lived thread).
"""

from __future__ import annotations

import datetime
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING

import structlog
import torch
import torch.distributed as dist

from pie.model.parallel import TensorParallel

from ..device import to_device

if TYPE_CHECKING:
    from ..config import EngineConfig
    from .model_runner import ModelRunner
    from .step_layout import StepFacts

log = structlog.get_logger(__name__)

BOOT = ("import sys; sys.path[:0] = sys.argv[4:]; "
        "from pie.engine.runner.tensor_parallel import worker_main; worker_main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))")
OP_STOP, OP_FORWARD, OP_NEW_CACHE, OP_CALIBRATE, OP_CAPTURE = 0, 1, 2, 3, 4
HEADER = 15  # int64 slots of the header: the op, then its numbers
GROUP_TIMEOUT = datetime.timedelta(days=7)  # idle servers: a worker waits for the next step this long
START_TIMEOUT_S = 600.0  # a worker that has not joined the group by then (loading aside) is lost


@dataclass(frozen=True, slots=True)
class WorkerInit:
    config: EngineConfig
    size: int
    store_port: int
    dtype_name: str  # the leader's resolved dtype (auto already decided)


def check_devices(config_device: torch.device, size: int, visible: int) -> None:
    """Refuses, before any process starts, a size that needs more GPUs than the process sees:
    NCCL puts one rank on each device, and two ranks cannot share one."""
    if config_device.type != "cuda":
        return
    first = config_device.index or 0
    if first + size > visible:
        raise ValueError(f"--tensor-parallel-size {size} needs GPUs cuda:{first}..cuda:{first + size - 1}, one per "
                         f"rank, but {visible} {'is' if visible == 1 else 'are'} visible "
                         "(CUDA_VISIBLE_DEVICES chooses which)")


def device_of(config_device: torch.device, rank: int) -> torch.device:
    """Rank r's device: the CPU, or CUDA device index base + r."""
    if config_device.type != "cuda":
        return config_device
    return torch.device("cuda", (config_device.index or 0) + rank)


class _Link:
    """Broadcasts from rank 0 (send) or into this rank (recv), on the group's device."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.header = torch.zeros(HEADER, dtype=torch.int64, device=device)

    def send_header(self, op: int, *numbers: int) -> None:
        values = [op, *numbers] + [0] * (HEADER - 1 - len(numbers))
        self.header.copy_(to_device(torch.tensor(values, dtype=torch.int64), self.device))
        dist.broadcast(self.header, src=0)

    def recv_header(self) -> list[int]:
        dist.broadcast(self.header, src=0)
        return self.header.tolist()

    def send(self, tensor: torch.Tensor) -> None:
        dist.broadcast(tensor.contiguous(), src=0)

    def recv(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return self.recv_into(torch.empty(numel, dtype=dtype, device=self.device))

    def recv_into(self, out: torch.Tensor) -> torch.Tensor:
        """Receives into `out` (contiguous: a view of a buffer a captured graph reads)."""
        dist.broadcast(out, src=0)
        return out


class Leader:
    """Rank 0's end: starts the workers, joins the group with them, and tells them each step."""

    def __init__(self, config: EngineConfig, size: int, device: torch.device, dtype_name: str) -> None:
        self.size = size
        self.device = device
        store = dist.TCPStore("127.0.0.1", 0, size, is_master=True, timeout=datetime.timedelta(seconds=START_TIMEOUT_S),
                              wait_for_workers=False)
        self._workers: list[subprocess.Popen] = []
        self._conns: list[Connection] = []
        init = WorkerInit(config, size, store.port, dtype_name)
        for rank in range(1, size):
            self._spawn(rank, init)
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, store=store, rank=0, world_size=size, timeout=GROUP_TIMEOUT)
        self.tp = TensorParallel(0, size)
        self._link = _Link(device)
        self._closed = False
        log.info("tensor_parallel_started", size=size, backend=backend, worker_pids=[p.pid for p in self._workers])

    def _spawn(self, rank: int, init: WorkerInit) -> None:
        parent_end, child_end = socket.socketpair()
        fd = child_end.fileno()
        proc = subprocess.Popen([sys.executable, "-c", BOOT, str(os.getpid()), str(rank), str(fd),
                                 *[p for p in sys.path if p]], pass_fds=(fd,), close_fds=True)
        child_end.close()
        conn = Connection(parent_end.detach())
        conn.send(init)
        self._workers.append(proc)
        self._conns.append(conn)

    # ---- what every rank does --------------------------------------------------------------
    def forward(self, facts: StepFacts, ints: torch.Tensor, tables: torch.Tensor, graph_batch: int | None,
                prompt_index: torch.Tensor | None) -> None:
        """Before rank 0's own forward pass: the workers start theirs on the same inputs, replaying
        their graph of `graph_batch` (its rows of whole-width tables) or eagerly (None).
        `prompt_index`: the token indices of prompt positions whose logits the step makes too
        (engine/runner/prompt_logprobs.py; eager steps only)."""
        b, w = tables.shape
        m = 0 if prompt_index is None else prompt_index.shape[0]
        self._link.send_header(OP_FORWARD, *facts.numbers(), b, w, graph_batch or 0, m)
        self._link.send(ints)
        self._link.send(tables)
        if prompt_index is not None:
            self._link.send(prompt_index)

    def capture(self) -> None:
        """Before rank 0 captures its CUDA graphs: the workers capture theirs alongside."""
        self._link.send_header(OP_CAPTURE)

    def new_cache(self, num_blocks: int) -> None:
        self._link.send_header(OP_NEW_CACHE, num_blocks)

    def calibrate(self, token_ids: list[int]) -> None:
        self._link.send_header(OP_CALIBRATE, len(token_ids))
        self._link.send(to_device(torch.tensor(token_ids, dtype=torch.int64), self.device))

    # ---- health and shutdown ---------------------------------------------------------------
    def lost(self) -> str | None:
        """How the workers are doing, when one has exited (waiting briefly for one that is
        exiting: a broken collective usually comes a moment before the exit); None when all run."""
        deadline = time.monotonic() + 1.0
        while True:
            gone = [(rank, p.poll()) for rank, p in enumerate(self._workers, start=1) if p.poll() is not None]
            if gone or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        if not gone:
            return None
        return "; ".join(f"tensor-parallel worker rank {rank} exited with status {code}" for rank, code in gone)

    def close(self) -> None:
        """Stops the workers (STOP when the group still works, then SIGKILL after a grace)."""
        if self._closed:
            return
        self._closed = True
        if all(p.poll() is None for p in self._workers):
            try:
                self._link.send_header(OP_STOP)
            except Exception:  # a broken group: the workers are killed below
                pass
        deadline = time.monotonic() + 10.0
        for p in self._workers:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for conn in self._conns:
            conn.close()
        destroy_group()


def destroy_group(timeout_s: float = 10.0) -> None:
    """Destroys the process group, waiting at most `timeout_s`: destroying one whose NCCL
    collectives were captured in CUDA graphs has been seen to hang (pytorch/pytorch#115388), and
    shutting down must not. A destroy still running then is left to the process's exit."""
    def destroy() -> None:
        try:
            dist.destroy_process_group()
        except Exception as e:  # a group broken by a lost rank
            log.info("process_group_destroy_failed", error=str(e))

    thread = threading.Thread(target=destroy, name="destroy-process-group", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        log.warning("process_group_destroy_timed_out", timeout_s=timeout_s)


# ---- the worker process ----------------------------------------------------------------------

def _watch_parent(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(0.2)
    os._exit(70)


@torch.inference_mode()
def follow(runner: ModelRunner, numbers: list[int], link: _Link) -> None:
    """A worker's step: receives the inputs rank 0 broadcast (Leader.forward) and runs its share of
    the forward pass and of the LM head (the logits are rank 0's). A step rank 0 replays from a
    graph replays this rank's graph of the same bucket, its inputs received into the staging
    buffers that graph reads."""
    from .model_runner import last_tokens
    from .prompt_logprobs import run_on_worker
    from .step_layout import Packed, StepFacts

    n = len(StepFacts.__slots__)  # StepFacts.numbers(), then the header's own four
    facts = StepFacts(*numbers[:n])
    b, w, graph_batch, num_prompt_rows = numbers[n:n + 4]
    stager = runner.stager
    if graph_batch:
        assert stager.dev_tables is not None and w == stager.dev_tables.shape[1], "graph tables are whole-width"
        link.recv_into(stager.dev_ints[:facts.n_ints])
        link.recv_into(stager.dev_tables[:b])
        runner.graphs.replay(graph_batch)
        return
    ints = link.recv(facts.n_ints, torch.int32)
    tables = link.recv(b * w, torch.int32).view(b, w)
    prompt_index = link.recv(num_prompt_rows, torch.int64) if num_prompt_rows else None
    layout = Packed(n_tok=facts.n_tok, rows=facts.rows)
    metadata = facts.metadata(ints, tables)
    runner.attention.metadata = metadata
    try:
        hidden = runner.model(ints[layout.ids], ints[layout.positions], runner.attention)
    finally:
        runner.attention.metadata = None
    runner.model.compute_logits(last_tokens(hidden, metadata))
    if prompt_index is not None:  # the prompt positions' logits, in rank 0's slices
        run_on_worker(hidden, prompt_index, runner.vocab_size, runner.model.compute_logits)


def worker_main(parent_pid: int, rank: int, fd: int) -> None:
    """A worker's whole life: join the group, load its share, follow rank 0 until STOP."""
    if os.getppid() != parent_pid:
        os._exit(70)
    threading.Thread(target=_watch_parent, args=(parent_pid,), name="parent-watch", daemon=True).start()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the server decides when the engine stops
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    conn = Connection(fd)
    init: WorkerInit = conn.recv()
    config = init.config
    from pie.model import smoothing
    from pie.model.loader import load_model

    from ..config import usable_cores
    from ..device import TORCH_DTYPES, resolve_device
    from .kv_cache import KVCache
    from .model_runner import ModelRunner

    device = device_of(resolve_device(config.device), rank)
    if device.type == "cpu":  # the ranks share the cores (rank 0 leaves one to the gRPC loop)
        torch.set_num_threads(config.cpu_threads or max(1, (usable_cores() - 1) // init.size))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    store = dist.TCPStore("127.0.0.1", init.store_port, init.size, is_master=False,
                          timeout=datetime.timedelta(seconds=START_TIMEOUT_S))
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=store, rank=rank,
                            world_size=init.size, timeout=GROUP_TIMEOUT)
    tp = TensorParallel(rank, init.size)
    model, _ = load_model(config.model, device=device, dtype=TORCH_DTYPES[init.dtype_name], tp=tp)
    model.eval()
    if device.type == "cuda":
        from pie.kernels import triton_fused

        model.use_fused_ops(triton_fused)
    local = model.config
    link = _Link(device)
    runner: ModelRunner | None = None
    with torch.inference_mode():
        while True:
            op, *numbers = link.recv_header()
            if op == OP_STOP:
                break
            if op == OP_CALIBRATE:
                ids = link.recv(numbers[0], torch.int64).tolist()
                smoothing.fold(model, smoothing.calibrate(model, ids, choose=config.kv_smoothing == "auto"))
            elif op == OP_NEW_CACHE:
                runner = None
                cache = KVCache(num_layers=local.num_hidden_layers, num_blocks=numbers[0],
                                block_size=config.block_size, num_kv_heads=local.num_key_value_heads,
                                head_dim=local.head_dim, kv_cache_dtype=config.kv_cache_dtype, device=device)
                max_model_len = min(config.max_model_len or model.full_config.max_model_len,
                                    model.full_config.max_model_len)
                runner = ModelRunner.for_model(model, cache, config, device, max_model_len)
            elif op == OP_FORWARD:
                assert runner is not None, "a forward pass before any KV pool"
                follow(runner, numbers, link)
            elif op == OP_CAPTURE:
                assert runner is not None, "graphs before any KV pool"
                runner.capture_cuda_graphs()
            else:
                raise RuntimeError(f"unknown tensor-parallel op {op}")
    runner = None  # its CUDA graphs go before the group they captured collectives of
    destroy_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # not the interpreter's teardown: a destroy left running must not hold the exit
