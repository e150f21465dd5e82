"""Start a tensor-parallel engine: rank 0 in this process, ranks 1..N-1 as spawned workers.

Rank 0 opens a TCPStore on a free loopback port (bound first, so no port race), spawns the
workers with torch.multiprocessing (daemonic: they die with the server), and every rank
joins the group, loads only its shard of the checkpoint, and agrees on the KV-cache and
adapter-pool sizes (the minimum over ranks). A worker exits when its parent dies; rank 0
checks before each step that no worker has exited.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import threading
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from loraplex.inference_server.engine.config import EngineConfig
from loraplex.inference_server.engine.factory import adapter_source, assemble, plan_device_memory
from loraplex.inference_server.engine.model_runner import ModelRunner
from loraplex.inference_server.lora.pool.adapter_pool import AdapterPool
from loraplex.inference_server.model.checkpoint import Checkpoint, ModelSource
from loraplex.inference_server.model.loading import load_checkpoint
from loraplex.inference_server.parallel.adapters import TensorParallelPacking
from loraplex.inference_server.parallel.group import TPGroup, join_group, leave_group, rank_device
from loraplex.inference_server.parallel.layers import TensorParallelLM
from loraplex.inference_server.parallel.lora import attach_tp_lora
from loraplex.inference_server.parallel.peers import TensorParallelPeers
from loraplex.inference_server.parallel.shard import load_sharded_model, local_config
from loraplex.inference_server.parallel.worker import TensorParallelWorker

log = logging.getLogger(__name__)

STEP_TIMEOUT_S = 600.0  # a collective inside a step (or start-up) that waits longer fails


@dataclass(frozen=True, slots=True)
class WorkerArgs:
    rank: int
    world_size: int
    port: int
    model: ModelSource
    config: EngineConfig
    parent_pid: int


class WorkerProcesses:
    """The spawned ranks 1..N-1."""

    def __init__(self, procs: list) -> None:
        self.procs = procs

    def all_alive(self) -> bool:
        return all(p.exitcode is None for p in self.procs)

    def check_alive(self) -> None:
        for p in self.procs:
            if p.exitcode is not None:
                raise RuntimeError(
                    f"tensor-parallel worker {p.name} exited with code {p.exitcode}; the engine cannot run steps "
                    "(see its log, then restart the server)"
                )

    def stop(self, timeout_s: float = 10.0) -> None:
        """Join each worker; kill any still running after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join(5.0)


def start_workers(world_size: int, port: int, model: ModelSource, config: EngineConfig) -> WorkerProcesses:
    ctx = mp.get_context("spawn")
    procs = []
    for rank in range(1, world_size):
        args = WorkerArgs(rank, world_size, port, model, config, os.getpid())
        proc = ctx.Process(target=worker_main, args=(args,), name=f"loraplex-tp-rank{rank}", daemon=True)
        proc.start()
        procs.append(proc)
    return WorkerProcesses(procs)


def _exit_with_parent(parent_pid: int) -> None:
    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def worker_main(args: WorkerArgs) -> None:
    """Entry point of a spawned worker rank: join, load the shard, serve steps until told to stop."""
    _exit_with_parent(args.parent_pid)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank{args.rank} %(levelname)s %(name)s: %(message)s")
    device = rank_device(args.config.device, args.rank)
    if device == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.world_size))
    try:
        store = dist.TCPStore("127.0.0.1", args.port, args.world_size, is_master=False,
                              timeout=datetime.timedelta(seconds=STEP_TIMEOUT_S))
        group = join_group(args.rank, args.world_size, device, store, STEP_TIMEOUT_S)
        ckpt = load_checkpoint(args.model, args.config.torch_dtype)
        model, num_blocks, pool = load_rank(ckpt, args.config, group)
        cfg = args.config
        worker = TensorParallelWorker(model, group, num_blocks, cfg.block_size, pool // _elem(cfg), cfg.torch_dtype,
                                      cfg.max_num_seqs, cfg.max_num_batched_tokens)
        worker.serve()
    except BaseException:  # noqa: BLE001  (a dead rank makes rank 0's next collective fail at once)
        log.exception("tensor-parallel worker rank %d failed", args.rank)
        os._exit(1)
    leave_group()


def _elem(config: EngineConfig) -> int:
    return torch.tensor([], dtype=config.torch_dtype).element_size()


def load_rank(ckpt: Checkpoint, config: EngineConfig, group: TPGroup) -> tuple[TensorParallelLM, int, int]:
    """This rank's model shard, and the KV blocks and pool bytes every rank agrees on."""
    dtype = config.torch_dtype
    model = load_sharded_model(ckpt.config, ckpt.iter_tensors(), group.device, dtype, group)
    rank_config = dataclasses.replace(config, device=group.device)
    elem = _elem(config)
    memory = plan_device_memory(rank_config, model.local_config, elem, None)
    return model, group.min_int(memory.num_kv_blocks), group.min_int(memory.pool_bytes)


def _check_devices(config: EngineConfig) -> None:
    if config.device == "cpu":
        return
    last = rank_device(config.device, config.tensor_parallel_size - 1)
    if int(last.split(":")[1]) >= torch.cuda.device_count():
        raise ValueError(
            f"--tensor-parallel {config.tensor_parallel_size} from {config.device} needs {last}, but this host "
            f"has {torch.cuda.device_count()} CUDA device(s)"
        )


def build_parallel_engine(cls, config: EngineConfig, model: ModelSource, adapters, progress: bool = True):
    """The engine of rank 0 over ``config.tensor_parallel_size`` ranks (1 = this process alone)."""
    world = config.tensor_parallel_size
    _check_devices(config)
    ckpt = load_checkpoint(model, config.torch_dtype, progress=progress)
    local_config(ckpt.config, world)  # refuse a size that does not divide the heads before spawning
    device = rank_device(config.device, 0)
    workers = None
    if world == 1:
        group = TPGroup.single(device)
    else:
        store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=STEP_TIMEOUT_S))
        workers = start_workers(world, store.port, model, config)
        log.info("tensor parallel: %d ranks, store on 127.0.0.1:%d", world, store.port)
    try:
        if workers is not None:
            group = join_group(0, world, device, store, STEP_TIMEOUT_S)
        module, blocks, pool = load_rank(ckpt, config, group)
        adapters = adapter_source(adapters, ckpt.config, config)
        rank0 = dataclasses.replace(config, device=device, num_kv_blocks=blocks, adapter_pool_bytes=pool,
                                    adapter_pool_memory_fraction=None)

        packing = TensorParallelPacking(ckpt.config, world)
        peers = TensorParallelPeers(group, packing, workers)

        def runner(module, _model_config, block_manager, manager, max_num_seqs, max_num_batched_tokens):
            return ModelRunner(module, module.local_config, block_manager, manager.pool, max_num_seqs,
                               max_num_batched_tokens, lora_attach=attach_tp_lora, peers=peers)

        return assemble(cls, rank0, module, ckpt.config, ckpt.tokenizer, adapters,
                        manager_factory=lambda *a: AdapterPool(*a, host_packing=packing), runner_factory=runner)
    except BaseException:
        if workers is not None:
            workers.stop(timeout_s=0.0)
            leave_group()
        raise
