"""verl on this machine: a CPU platform where verl has none, the process group verl's
workers expect, and the environment verl reads its choices from.

**CPU.** verl 0.9.1 knows CUDA, NPU and ROCm platforms only; on a machine without them
:func:`ensure_cpu_platform` registers a CPU platform through verl's own plugin registry
(``verl.plugin.platform.PlatformRegistry``/``set_platform``: device ``cpu``, collective
backend ``gloo``), and :func:`ensure_process_group` starts a 1-process gloo group, so
verl's FSDP2 engine runs in-process (on Ray, each worker's group of ``RANK``/``WORLD_SIZE``).
"""

from __future__ import annotations

import os
import types
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from agl.core.ports import free_port

__all__ = ["ensure_cpu_platform", "ensure_process_group", "override_env"]


def ensure_cpu_platform() -> str:
    """verl's platform name here; registers and selects a CPU platform if verl has none.

    verl falls back to CUDA when it detects no accelerator, and then fails at the first
    ``torch.cuda`` call; the plugin registry is verl's own way to add a device.
    """
    import torch
    from verl.plugin.platform import (
        PlatformBase,
        PlatformRegistry,
        get_platform,
        platform_manager,
        set_platform,
    )

    current = platform_manager._current_platform
    if current is not None and current.is_available():
        return current.device_name
    if current is None:
        try:
            platform = get_platform()
            if platform.is_available():
                return platform.device_name
        except Exception:
            pass

    class CPUPlatform(PlatformBase):
        """Plain CPU: device ``cpu``, gloo collectives, no profiler, no IPC."""

        @property
        def device_name(self) -> str:
            return "cpu"

        @property
        def vendor_name(self) -> str:
            return "cpu"

        @property
        def device_module(self) -> Any:
            return _CPU_DEVICE_MODULE

        def is_available(self) -> bool:
            return True

        def current_device(self) -> Any:
            return "cpu"  # verl passes it to .to(): a device, not a CUDA index

        def device_count(self) -> int:
            return 1

        def set_device(self, device_index: int) -> None:
            return None

        def synchronize(self, device_index: int | None = None) -> None:
            return None

        def manual_seed(self, seed: int) -> None:
            torch.manual_seed(seed)

        def manual_seed_all(self, seed: int) -> None:
            torch.manual_seed(seed)

        def set_allocator_settings(self, settings: str) -> None:
            return None

        def empty_cache(self) -> None:
            return None

        def get_device_capability(self, device_index: int = 0) -> tuple[None, None]:
            return None, None

        def communication_backend_name(self) -> str:
            return "gloo"

        def visible_devices_envvar(self) -> str:
            return "CUDA_VISIBLE_DEVICES"

        @contextmanager
        def nvtx_range(self, msg: str) -> Iterator[None]:
            yield

        def profiler_start(self) -> None:
            return None

        def profiler_stop(self) -> None:
            return None

        def ray_resource_name(self) -> str:
            return "CPU"

        def ray_noset_envvars(self) -> list[str]:
            return []

        def is_ipc_supported(self) -> bool:
            return False

        def cudart(self) -> None:
            return None

    PlatformRegistry.register(platform="cpu")(CPUPlatform)
    set_platform(CPUPlatform())
    return "cpu"


class _CPUDeviceModule(types.ModuleType):
    """``torch.cpu`` plus the CUDA-style memory counters verl's worker logs (0 here)."""

    def __getattr__(self, name: str) -> Any:
        import torch

        if name == "get_device_name":
            return lambda *args, **kwargs: "CPU"  # verl's flops table: unknown = inf
        if name in ("get_rng_state", "set_rng_state"):
            return getattr(torch, name)  # checkpoints save "the device's" RNG: the CPU's
        if name == "mem_get_info":
            return lambda *args, **kwargs: (0, 0)
        if name.startswith(("max_memory_", "memory_", "reset_peak_memory")):
            return lambda *args, **kwargs: 0
        return getattr(torch.cpu, name)


_CPU_DEVICE_MODULE = _CPUDeviceModule("agl_verl_cpu")


def ensure_process_group() -> None:
    """A 1-process group (gloo on CPU) unless one is running; sets the env verl's
    ``Worker`` reads (RANK, WORLD_SIZE, MASTER_ADDR/PORT) where unset."""
    import torch.distributed as dist
    from verl.utils.device import get_device_name

    if not dist.is_initialized():
        backend = "gloo" if get_device_name() == "cpu" else f"cpu:gloo,{get_device_name()}:nccl"
        rank = int(os.environ.get("RANK", 0))
        world_size = int(os.environ.get("WORLD_SIZE", 1))
        if world_size == 1:
            # One process needs no rendezvous: an in-memory store, no port to race for
            # (a port picked free and bound later was taken meanwhile in agl.train runs).
            dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1)
        else:
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(free_port()))
            dist.init_process_group(backend=backend, rank=rank, world_size=world_size)
    os.environ.setdefault("RANK", str(dist.get_rank()))
    os.environ.setdefault("WORLD_SIZE", str(dist.get_world_size()))
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))


@contextmanager
def override_env(name: str, value: str) -> Iterator[None]:
    """``name=value`` in the environment for the block (verl reads its engine choice,
    ``VERL_ENGINE_DEVICE``, from there when it builds a worker); restored after."""
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old
