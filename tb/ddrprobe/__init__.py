"""cocotb bench of the DDR bandwidth probe (`hdl.ddrprobe.DdrProbe`): `bench.ProbeBench` (DDR behind every port
with latency and random pauses, the CSR master on ``s_axi``, a bus monitor, the host device) and the tests in
`test_ddrprobe`, which check the RTL's bursts and counters against `sim.ddrprobe` and run the host tool
(`firmware.ddrprobe.measure`) on the simulated probe. `test_gemv_pattern` runs on the GEMV engine
(`hdl.gemv.GemvEngine`, tb/gemv's bench) and checks that the model's bursts are the engine's."""
