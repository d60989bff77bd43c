#!/usr/bin/env bash
# Session 15 call 6: the service benchmark (run 6) on main 1a57459.
T_SERVICE=470 SERVICE_ARGS="--ms 1,16,256,1024,2048 --reps 3" bash benchmarks/device_check.sh service 2>&1 | tail -40
