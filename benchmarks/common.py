"""What the benchmark scripts share: their flags' parser, the flags whose default depends on
--tiny, the default device, and the refusal of the GPU-only scripts on a machine without CUDA.

Not a script (no `__main__` block), so `pie bench` does not list it. Importing it loads
service.cli (for the help formatter) and torch, never CUDA: every script builds and parses its
flags before it touches a device, so `--help` works on any machine.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from pie.service.help_format import HelpFormatter

DEVICE_HELP = "device to run on: cpu or cuda (default: cuda where a CUDA GPU is visible, else cpu)"


def make_parser(description: str | None) -> argparse.ArgumentParser:
    """A script's parser: the description keeps its line breaks, and every flag's help ends with
    its default, once (service.help_format.HelpFormatter)."""
    return argparse.ArgumentParser(description=description, formatter_class=HelpFormatter)


def default_device() -> str:
    """What --device means when not given."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def require_cuda(parser: argparse.ArgumentParser) -> None:
    """For a GPU-only script (`NEEDS_GPU = True`), once its flags are parsed: where no CUDA GPU is
    visible, one line on stderr and exit status 2, before any work."""
    if not torch.cuda.is_available():
        parser.exit(2, f"{parser.prog}: this benchmark needs a CUDA GPU and none is visible "
                       "(torch.cuda.is_available() is False)\n")


class SizedFlags:
    """Flags whose default depends on --tiny, on the one parser (so --help lists every flag): each
    is added with default None and the help "(default: FULL; TINY with --tiny)", and `fill`
    writes the default of the chosen size into the flags left out after parsing."""

    def __init__(self, parser: argparse.ArgumentParser, switch: str = "--tiny") -> None:
        self._parser = parser
        self._switch = switch
        self._defaults: dict[str, tuple[Any, Any]] = {}  # dest -> (full-size default, tiny default)

    def add(self, flag: str, full: Any, tiny: Any, help: str, *, type: Callable[[str], Any] = int,
            shown: tuple[str, str] | None = None, **kwargs: Any) -> None:
        """`shown`: the two defaults in words, where their values read badly (None, bytes)."""
        full_text, tiny_text = shown or (full, tiny)
        action = self._parser.add_argument(
            flag, type=type, default=None, help=f"{help} (default: {full_text}; {tiny_text} with {self._switch})",
            **kwargs)
        self._defaults[action.dest] = (full, tiny)

    def fill(self, args: argparse.Namespace, tiny: bool) -> argparse.Namespace:
        for dest, (full, small) in self._defaults.items():
            if getattr(args, dest) is None:
                setattr(args, dest, small if tiny else full)
        return args


def _cpu_list(text: str) -> set[int]:
    """sysfs' CPU list ("0-15,32-47") as a set."""
    cpus: set[int] = set()
    for part in filter(None, text.strip().split(",")):
        first, _, last = part.partition("-")
        cpus.update(range(int(first), int(last or first) + 1))
    return cpus


def _gpu_pci_folder() -> Path | None:
    """The sysfs folder of the current CUDA device, where torch tells its PCI address."""
    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    domain, bus, device = (getattr(props, k, None) for k in ("pci_domain_id", "pci_bus_id", "pci_device_id"))
    if bus is None or device is None:
        return None
    folder = Path(f"/sys/bus/pci/devices/{domain or 0:04x}:{bus:02x}:{device:02x}.0")
    return folder if folder.is_dir() else None


def gpu_local_cpus() -> set[int] | None:
    """The CPUs of the NUMA node the GPU hangs off (sysfs' local_cpulist); None where unknown."""
    folder = _gpu_pci_folder()
    if folder is None or not (folder / "local_cpulist").exists():
        return None
    return _cpu_list((folder / "local_cpulist").read_text()) or None


def pin_to_gpu_node() -> str:
    """Confines this process (and the threads it starts from now on) to the GPU's NUMA-local CPUs
    that it may run on; returns what it did, for the output."""
    local = gpu_local_cpus()
    allowed = os.sched_getaffinity(0)
    if not local or not local & allowed:
        return "not pinned: the GPU's NUMA-local CPUs are unknown here"
    os.sched_setaffinity(0, local & allowed)
    return f"pinned to the GPU's {len(local & allowed)} NUMA-local CPUs"


def host_facts() -> str:
    """One line on where the host side ran: the CPU this thread is on and its clock, how many CPUs
    it may use, the load, and whether that CPU is on the GPU's NUMA node (a host that runs the
    same step at two speeds leaves these to compare)."""
    cpu = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[36])  # field 39, `processor`
    freq = Path(f"/sys/devices/system/cpu/cpu{cpu}/cpufreq/scaling_cur_freq")
    mhz = f"{int(freq.read_text()) / 1e3:.0f} MHz" if freq.exists() else "clock unknown"
    local = gpu_local_cpus()
    node = "" if local is None else f", {'on' if cpu in local else 'off'} the GPU's NUMA node"
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    return (f"host: cpu {cpu} at {mhz}{node}; {len(os.sched_getaffinity(0))} of {os.cpu_count()} CPUs allowed; "
            f"load {load}")
