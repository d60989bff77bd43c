bash benchmarks/wgmma_rs.sh ss (call 3)
