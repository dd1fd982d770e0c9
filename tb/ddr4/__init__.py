"""A DDR4 channel model for the benches: the K26 SOM's DDR4-2400 x64 channel behind the Zynq UltraScale+ DDR
controller. `model` is the pure-Python core (`Ddr4Channel`, its parameters and sources in `Ddr4Params`,
`check_timing`); `axi` serves a DUT's AXI4 ports from it in cocotb (`Ddr4AxiMemory`), tested by `test_axi` on a
passthrough (`passthrough.AxiPassthrough`); `test_probe` runs the DDR probe (`hdl.ddrprobe.DdrProbe`) behind it
(`python -m benchmarks.ddr`)."""

from .model import Burst, Command, Ddr4Channel, Ddr4Params, TimingViolation, check_timing

__all__ = ["Burst", "Command", "Ddr4Channel", "Ddr4Params", "TimingViolation", "check_timing"]
