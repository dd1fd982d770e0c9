"""The Kria app folder of a KV260 system build, and the board's reserved-memory fragment.

dfx-mgr (``xmutil loadapp <app>``) loads ``/lib/firmware/xilinx/<app>/``: ``<app>.bit.bin``,
``<app>.dtbo`` (the same base name) and ``shell.json`` (kria-apps-docs ``target.md``; Xilinx/dfx-mgr).
`write_app` writes the folder (everything but the bitstream, which Vivado makes):

``<app>.dtsi``  the overlay source, after kria-apps-firmware's KV260 apps:

    ``&fpga_full``   ``firmware-name = "<app>.bit.bin"`` and the PS-PL resets 116-119 (pl_resetn0..3; the
                     system uses pl_resetn0, reset 116);
    ``&amba``        ``clocking0`` (``xlnx,fclk``: pl_clk0, ``zynqmp_clk`` 71, at `hdl.kv260.PL_CLK0_HZ`);
                     ``afi0`` (``xlnx,afi-fpga``: the HP0..3 read/write widths, regids 4-11, and the HPM0
                     width, regid 14, from the system's ports); ``npu`` (``generic-uio`` at the memory map's
                     CSR window, its interrupt the memory map's SPI, level high: ``/dev/uioN`` named ``npu``;
                     Kria Ubuntu's command line already binds ``generic-uio`` to ``uio_pdrv_genirq``);
    ``&{/}``         one ``ikwzm,u-dma-buf`` node per DDR window (``device-name`` = the window's name, so user
                     space sees ``/dev/<name>`` and ``/sys/class/u-dma-buf/<name>/phys_addr``; 64-bit ``size`` =
                     the window; ``memory-region`` = the window's reserved-memory node; ``dma-mask = <40>``, the
                     HP ports' address width).

``<app>.dtbo``  the overlay compiled with ``dtc -@ -I dts -O dtb`` (Debian: ``device-tree-compiler``).
``shell.json``  ``{"shell_type": "XRT_FLAT", "num_slots": "1"}``.

An overlay cannot add reserved memory, so `reserved_memory_dtsi` writes the fragment for the board's
``/boot/firmware/user-override.dtb`` (the tree U-Boot on Kria Ubuntu 22.04 loads instead of the built-in
one): one ``shared-dma-pool`` per window with the window's ``reg``, labelled ``<name>_reserved`` so the
overlay's u-dma-buf nodes resolve against the base tree's symbols. The pools are ``reusable`` (CMA)
rather than ``no-map``: a ``no-map`` pool is a per-device coherent pool, which hands out buffers in
power-of-two blocks (``kernel/dma/coherent.c``: ``bitmap_find_free_region(..., get_order(size))``), so a
1,856 MiB u-dma-buf would need a 2 GiB pool; a CMA pool hands out exactly the pages asked for, and the
window's whole size is one u-dma-buf at the window's base.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

from .memory_map import MemoryMap, memory_map

__all__ = ["DtcNotFound", "overlay_dtsi", "reserved_memory_dtsi", "compile_dts", "write_app", "SHELL_JSON",
           "PL_RESETS", "ZYNQMP_CLK_PL0", "UDMABUF_DMA_MASK"]

SHELL_JSON = {"shell_type": "XRT_FLAT", "num_slots": "1"}
PL_RESETS = (116, 117, 118, 119)        # zynqmp_reset IDs of pl_resetn0..3, as kria-apps-firmware lists them
ZYNQMP_CLK_PL0 = 71                     # zynqmp_clk ID of pl_clk0
UDMABUF_DMA_MASK = 40                   # the HP ports' physical address width


class DtcNotFound(RuntimeError):
    pass


def _cells64(v: int) -> str:
    return f"0x{v >> 32:x} 0x{v & 0xFFFF_FFFF:08x}"


def _label(name: str) -> str:
    return f"{name}_reserved"


def overlay_dtsi(app: str, mmap: MemoryMap | str, afi_config, *, pl_clk0_hz: int) -> str:
    """The overlay source of app `app` for the memory map `mmap` (`hdl.memory_map`) and the AFI widths
    `afi_config` (`hdl.kv260.Kv260System.afi_config`)."""
    mmap = memory_map(mmap)
    resets = ", ".join(f"<&zynqmp_reset {r}>" for r in PL_RESETS)
    afi = ", ".join(f"<{reg} 0x{val:x}>" for reg, val in afi_config)
    lines = [
        f"// {app}: the Kria app overlay of the gemma3n NPU system (python -m hdl.build).",
        f"// Load: xmutil loadapp {app} (files in /lib/firmware/xilinx/{app}/). The u-dma-buf nodes need the",
        "// reserved-memory nodes of reserved-memory.dtsi in the board's /boot/firmware/user-override.dtb.",
        "/dts-v1/;",
        "/plugin/;",
        "",
        "&fpga_full {",
        "\t#address-cells = <2>;",
        "\t#size-cells = <2>;",
        f"\tfirmware-name = \"{app}.bit.bin\";",
        f"\tresets = {resets};",
        "};",
        "",
        "&amba {",
        "\t#address-cells = <2>;",
        "\t#size-cells = <2>;",
        "",
        "\tclocking0: clocking0 {",
        "\t\tcompatible = \"xlnx,fclk\";",
        "\t\t#clock-cells = <0>;",
        f"\t\tclocks = <&zynqmp_clk {ZYNQMP_CLK_PL0}>;",
        f"\t\tassigned-clocks = <&zynqmp_clk {ZYNQMP_CLK_PL0}>;",
        f"\t\tassigned-clock-rates = <{pl_clk0_hz}>;",
        "\t\tclock-output-names = \"fabric_clk\";",
        "\t};",
        "",
        "\t// AXI widths: regids 4-11 HP0..3 read/write (0 = 128, 1 = 64, 2 = 32 bit); 14 HPM0/HPM1 (bits 9:8, 11:10).",
        "\tafi0: afi0 {",
        "\t\tcompatible = \"xlnx,afi-fpga\";",
        f"\t\tconfig-afi = {afi};",
        "\t};",
        "",
        f"\tnpu: npu@{mmap.csr_base:x} {{",
        "\t\tcompatible = \"generic-uio\";",
        f"\t\treg = <{_cells64(mmap.csr_base)} {_cells64(mmap.csr_size)}>;",
        "\t\tinterrupt-parent = <&gic>;",
        f"\t\tinterrupts = <0 {mmap.irq_spi} 4>;",
        "\t};",
        "};",
        "",
        "&{/} {",
    ]
    for w in mmap.windows:
        lines += [
            f"\tudmabuf_{w.name}: udmabuf-{w.name} {{",
            "\t\tcompatible = \"ikwzm,u-dma-buf\";",
            f"\t\tdevice-name = \"{w.name}\";",
            f"\t\tsize = <{_cells64(w.size)}>;",
            f"\t\tmemory-region = <&{_label(w.name)}>;",
            f"\t\tdma-mask = <{UDMABUF_DMA_MASK}>;",
            "\t};",
        ]
    lines += ["};", ""]
    return "\n".join(lines)


def reserved_memory_dtsi(mmap: MemoryMap | str) -> str:
    """The reserved-memory nodes of `mmap`'s windows, as a fragment to merge into the board's device tree
    (the comment at its top gives the steps)."""
    mmap = memory_map(mmap)
    lines = [
        f"// The NPU's DDR windows (hdl.memory_map \"{mmap.name}\", {mmap.total >> 20} MiB) as reserved memory.",
        "// An overlay cannot reserve memory; this fragment goes into the board's own tree, which U-Boot on",
        "// Kria Ubuntu loads from /boot/firmware/user-override.dtb when that file exists:",
        "//   1. decompile the running tree:   dtc -I dtb -O dts -o system.dts /sys/firmware/fdt",
        "//   2. append this file to system.dts (a second '/ { reserved-memory { ... }; };' merges into the first)",
        "//   3. compile it with its symbols: dtc -@ -I dts -O dtb -o user-override.dtb system.dts",
        "//   4. install and reboot:          sudo cp user-override.dtb /boot/firmware/ && sudo reboot",
        "// The labels (<window>_reserved) are what the app overlay's u-dma-buf nodes point at.",
        "/ {",
        "\treserved-memory {",
        "\t\t#address-cells = <2>;",
        "\t\t#size-cells = <2>;",
        "\t\tranges;",
    ]
    for w in mmap.windows:
        lines += [
            "",
            f"\t\t{_label(w.name)}: {w.name}@{w.base:x} {{",
            "\t\t\tcompatible = \"shared-dma-pool\";",
            "\t\t\treusable;",
            f"\t\t\treg = <{_cells64(w.base)} {_cells64(w.size)}>;",
            "\t\t};",
        ]
    lines += ["\t};", "};", ""]
    return "\n".join(lines)


def compile_dts(src: Path, out: Path, *, plugin_symbols: bool = True) -> None:
    """``dtc -@ -I dts -O dtb -o out src``; `DtcNotFound` when dtc is not installed, RuntimeError with dtc's
    message when it rejects the source."""
    dtc = shutil.which("dtc")
    if dtc is None:
        raise DtcNotFound("dtc (the device tree compiler) is not on PATH: install the Debian package "
                          "device-tree-compiler (`bash scripts/setup.sh` does)")
    cmd = [dtc, *(["-@"] if plugin_symbols else []), "-I", "dts", "-O", "dtb", "-o", str(out), str(src)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"dtc failed on {src}:\n{proc.stderr.strip()}")


def write_app(app_dir: Path, app: str, mmap: MemoryMap | str, afi_config, *, pl_clk0_hz: int) -> dict:
    """Write the app folder `app_dir` (``<app>.dtsi``, ``<app>.dtbo``, ``shell.json``) and, beside it, the
    board's ``reserved-memory.dtsi``; returns the paths by role. The ``.dtsi`` files are written before dtc
    runs, so a missing dtc (`DtcNotFound`) leaves the sources in place."""
    mmap = memory_map(mmap)
    app_dir = Path(app_dir)
    app_dir.mkdir(parents=True, exist_ok=True)
    dtsi = app_dir / f"{app}.dtsi"
    dtsi.write_text(overlay_dtsi(app, mmap, afi_config, pl_clk0_hz=pl_clk0_hz))
    shell = app_dir / "shell.json"
    shell.write_text(json.dumps(SHELL_JSON) + "\n")
    reserved = app_dir.parent / "reserved-memory.dtsi"
    reserved.write_text(reserved_memory_dtsi(mmap))
    dtbo = app_dir / f"{app}.dtbo"
    compile_dts(dtsi, dtbo)
    return {"dtsi": dtsi, "dtbo": dtbo, "shell": shell, "reserved_memory": reserved,
            "bitstream": app_dir / f"{app}.bit.bin"}
