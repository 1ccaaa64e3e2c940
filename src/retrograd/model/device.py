"""Device and thread selection: `auto`, `cpu` or `gpu`, and the compute dtype each one gets.

Knows torch's device queries; applies the thread count retrograd/threads.py chooses; nothing
about models.
`probe_device` answers without importing torch, for metadata-only commands; `list_backends`
reports every device this process could train on, with the dtypes it computes in.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib.util
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from retrograd import environ
from retrograd.errors import ConfigError, DeviceError
from retrograd.threads import choose_threads, default_threads

if TYPE_CHECKING:
    import torch

DEVICES = ("auto", "cpu", "gpu")


def gpu_available() -> bool:
    import torch

    return torch.cuda.is_available()


def probe_device(name: str = "auto") -> str:
    """The device `resolve_device(name)` would pick, told without importing torch."""
    if name not in DEVICES:
        raise ConfigError(f"--device {name}: must be one of auto, cpu, gpu")
    if name == "cpu":
        return "cpu"
    cuda = _torch_cuda_version()
    driver = Path("/proc/driver/nvidia/gpus").is_dir() or Path("/dev/nvidia0").exists()
    if cuda and driver:
        return f"cuda (PyTorch built for CUDA {cuda})"
    why = "PyTorch has no CUDA support" if not cuda else "no NVIDIA driver or GPU found"
    if name == "gpu":
        raise DeviceError(f"--device gpu: no GPU is available ({why}); use --device cpu or auto")
    return f"cpu ({why})"


def _torch_cuda_version() -> str | None:
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return None
    version = Path(list(spec.submodule_search_locations)[0]) / "version.py"
    try:
        m = re.search(r"^cuda\s*(?::[^=]*)?=\s*['\"]([^'\"]+)['\"]", version.read_text(), re.M)
    except OSError:
        return None
    return m.group(1) if m else None


def resolve_device(name: str = "auto") -> torch.device:
    import torch

    if name not in DEVICES:
        raise ConfigError(f"--device {name}: must be one of auto, cpu, gpu")
    if name == "cpu":
        return torch.device("cpu")
    if gpu_available():
        return torch.device("cuda")
    if name == "gpu":
        raise DeviceError(
            "--device gpu: no GPU is available to PyTorch (torch.cuda.is_available() is False); "
            "use --device cpu or auto"
        )
    return torch.device("cpu")


# ONEDNN_MAX_CPU_ISA's levels below oneDNN's bf16 kernels, ATEN_CPU_CAPABILITY's below AVX-512
_ONEDNN_WITHOUT_BF16 = ("SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX512_CORE", "AVX512_CORE_VNNI")
_ATEN_WITHOUT_AVX512 = ("default", "avx2")


def cpu_has_fast_bf16() -> bool:
    """AMX or AVX512-BF16, which oneDNN and PyTorch may use: bf16 matmuls then run several
    times faster than f32. oneDNN or PyTorch held below them (ONEDNN_MAX_CPU_ISA=AVX2,
    ATEN_CPU_CAPABILITY=avx2: `make test-avx2`) stands for a CPU without them."""
    flags = cpu_flags()
    if "amx_bf16" not in flags and "avx512_bf16" not in flags:
        return False
    onednn = os.environ.get("ONEDNN_MAX_CPU_ISA", "").strip().upper()
    aten = os.environ.get("ATEN_CPU_CAPABILITY", "").strip().lower()
    return onednn not in _ONEDNN_WITHOUT_BF16 and aten not in _ATEN_WITHOUT_AVX512


def cpu_flags() -> set[str]:
    """The CPU's feature flags (/proc/cpuinfo's "flags": avx2, avx512_bf16, amx_tile, ...);
    empty where the file is not there."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def default_dtype(device: torch.device) -> torch.dtype:
    """The fast compute dtype the device has: bf16 on recent GPUs and AMX CPUs, else f32.

    RETRO_DTYPE=float32 (or bfloat16) overrides the choice on every device, so a run computes
    the same numbers on a machine with bf16 instructions as on one without.
    """
    import torch

    forced = environ.get("RETRO_DTYPE")
    if forced:
        return parse_dtype(forced, device)
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32
    return torch.bfloat16 if cpu_has_fast_bf16() else torch.float32


def parse_dtype(name: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    import torch

    if name is None:
        return default_dtype(device)
    if isinstance(name, torch.dtype):
        return name
    table = {
        "float32": torch.float32,
        "f32": torch.float32,
        "bfloat16": torch.bfloat16,
        "bf16": torch.bfloat16,
        "float16": torch.float16,
        "f16": torch.float16,
    }
    if name not in table:
        raise ConfigError(f"dtype {name!r}: must be float32, bfloat16 or float16")
    return table[name]


def configure_allocator() -> None:
    """Keep freed large blocks in the process (glibc): a training step or a decode step
    allocates the same large temporaries every time (262k-wide logits, dequantized tiles), and
    glibc otherwise returns them to the system and takes the page faults again. No-op where
    mallopt is unavailable."""
    name = ctypes.util.find_library("c")
    if not name:
        return
    try:
        libc = ctypes.CDLL(name)
        libc.mallopt(-3, 32 << 20)  # M_MMAP_THRESHOLD
        libc.mallopt(-1, 1 << 30)  # M_TRIM_THRESHOLD
    except (OSError, AttributeError):
        pass


def configure_threads(threads: int | None = None) -> int:
    """Set torch's intra-op threads as retrograd/threads.py chooses them (RETRO_THREADS, else
    `threads`, else torch's own count bounded by the usable CPUs); the count in force."""
    return apply_threads(choose_threads(threads))


def apply_threads(chosen: int | None) -> int:
    """Set torch's intra-op threads to `chosen` (a compute plan's), or to torch's own count
    bounded by the usable CPUs when None; the count in force."""
    import torch

    if chosen is None:
        chosen = default_threads(torch.get_num_threads())
    if chosen != torch.get_num_threads():
        torch.set_num_threads(chosen)
    return chosen


def available_memory(device: torch.device) -> int:
    """Bytes that could still be allocated on the device."""
    import torch

    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    return _meminfo("MemAvailable:")


# -- what this process can train on ---------------------------------------------------------

DTYPE_NAMES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class Backend:
    """One device training can run on, as `list_backends` reports it."""

    device: str  # the [model].device / load(device=) word that selects its kind: cpu or gpu
    name: str  # torch's device: "cpu", "cuda:0"
    description: str  # the processor: the CPU's model name, the GPU's
    dtypes: tuple[str, ...]  # compute dtypes a matrix product runs in here, float32 first
    default_dtype: str  # what load(dtype=None) computes in (RETRO_DTYPE honoured)
    fast_bf16: bool  # bfloat16 products run on bf16 hardware (AMX / AVX512-BF16, a bf16 GPU)
    memory_bytes: int  # the device's memory (the machine's for the CPU); 0 when unknown
    available_bytes: int  # what could be allocated now; 0 when unknown
    auto: bool  # device="auto" picks this one


def list_backends() -> list[Backend]:
    """The CPU, then each GPU PyTorch sees (cuda:0, cuda:1, ...). Imports torch; on a GPU
    machine it starts CUDA (a context on each device)."""
    import torch

    gpus = torch.cuda.device_count() if gpu_available() else 0
    out = [_cpu_backend(auto=gpus == 0)]
    out += [_gpu_backend(torch.device("cuda", i), auto=i == 0) for i in range(gpus)]
    return out


def _cpu_backend(auto: bool) -> Backend:
    import torch

    cpu = torch.device("cpu")
    return Backend(
        device="cpu",
        name="cpu",
        description=cpu_name(),
        dtypes=_runs(cpu),
        default_dtype=_dtype_name(default_dtype(cpu)),
        fast_bf16=cpu_has_fast_bf16(),
        memory_bytes=_meminfo("MemTotal:"),
        available_bytes=available_memory(cpu),
        auto=auto,
    )


def _gpu_backend(device: torch.device, auto: bool) -> Backend:
    import torch

    with torch.cuda.device(device):
        props = torch.cuda.get_device_properties(device)
        bf16 = torch.cuda.is_bf16_supported()
        return Backend(
            device="gpu",
            name=str(device),
            description=props.name,
            dtypes=_runs(device),
            default_dtype=_dtype_name(default_dtype(device)),
            fast_bf16=bool(bf16),
            memory_bytes=int(props.total_memory),
            available_bytes=available_memory(device),
            auto=auto,
        )


def _runs(device: torch.device) -> tuple[str, ...]:
    """The dtypes a small matrix product runs in on `device` (float32 always)."""
    import torch

    found = []
    for name in DTYPE_NAMES:
        dtype = parse_dtype(name, device)
        try:
            a = torch.ones(4, 4, dtype=dtype, device=device)
            ok = bool(torch.isfinite((a @ a).float()).all())
        except (RuntimeError, TypeError):
            ok = False
        if ok:
            found.append(name)
    return tuple(found)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo), else what the platform says."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine() or "cpu"


def _meminfo(key: str) -> int:
    """A /proc/meminfo line's bytes ("MemTotal:", "MemAvailable:"); 0 where there is none."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
