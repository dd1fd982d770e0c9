"""Full-chip cocotb bench of the NPU (`hdl.npu.Npu`): `bench` (DDR, CSR master, the simulated device), `host`
(the host code it runs), `test_npu` (the cocotb tests) and ``python -m tb.npu`` (the command line)."""
