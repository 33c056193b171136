"""What the peers' workers (gpt_peer.py, mlp_peer.py) share: threads, the
process group, timing helpers. Each worker process is one rank, started by
peers.py with RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT set
(as torchrun would set them), OMP_NUM_THREADS and MKL_NUM_THREADS set to
its threads, and DS_ACCELERATOR=cpu for DeepSpeed."""
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402


def rank_and_world():
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def set_threads(threads):
    """Compute threads of this process: torch's intra-op pool (OpenMP) and MKL; one
    inter-op thread (nothing here runs operators in parallel with each other)."""
    import torch
    torch.set_num_threads(threads)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass  # already set (a second call in the same process)
    return torch.get_num_threads()


def init_gloo(world):
    """The default process group over gloo (TCP on the loopback), for world > 1."""
    import torch.distributed as dist
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("gloo")
    return dist


def barrier(dist, world):
    if world > 1:
        dist.barrier()


def all_sum(dist, world, values):
    """Sums a few floats over the ranks (float64)."""
    import torch
    t = torch.tensor(values, dtype=torch.float64)
    if world > 1:
        dist.all_reduce(t)
    return t.tolist()


def inductor_links_its_own_torch():
    """torch.compile's C++ kernels link -ltorch_cpu with Python's LIBDIR searched first
    (torch/_inductor/cpp_builder.py: python_libraries_dirs + torch_libraries_dirs). With
    Debian's Python that is /usr/lib/x86_64-linux-gnu, where Debian's libtorch-dev (PyTorch
    1.13, which this project's tests install) has a libtorch_cpu.so of its own: inductor's
    probe of the CPU's vector ISA then fails to load (undefined Sleef symbols), it finds no
    ISA (INVALID_VEC_ISA) and writes scalar kernels, about half the speed of eager here. This
    puts the venv's torch/lib first. Returns the ISA inductor picks."""
    import torch._inductor.cpp_builder as builder
    import torch._inductor.cpu_vec_isa as vec_isa
    original = builder._get_python_related_args
    torch_lib = os.path.join(os.path.dirname(os.path.dirname(builder.__file__)), "lib")

    def torch_lib_first():
        include_dirs, lib_dirs = original()
        return include_dirs, [torch_lib] + [d for d in lib_dirs if d != torch_lib]
    builder._get_python_related_args = torch_lib_first
    return str(vec_isa.pick_vec_isa()).replace(" ", "+") or "none"


class Clock:
    def __init__(self):
        self.start = time.perf_counter()

    def seconds(self):
        return time.perf_counter() - self.start


def say(rank, text):
    if rank == 0:
        print(text, flush=True)


__all__ = ["harness", "rank_and_world", "set_threads", "init_gloo", "barrier", "all_sum", "inductor_links_its_own_torch", "Clock", "say"]
