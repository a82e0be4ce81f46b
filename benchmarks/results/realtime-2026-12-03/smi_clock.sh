#!/bin/bash
# The SM clock while the GPU was busy (>= 1800 MHz), per call, from nvidia-smi's samples (run_device.sh).
cd "$(dirname "$0")"
for c in call1 call2 call3 call4; do cat $c/smi*.csv | awk -F', ' -v c=$c '{split($2,a," "); f=a[1]+0; if (f>=1800){n++; s+=f; if (f<1980) low++; if ($7=="0x0000000000000004") cap++}} END{printf "%s: %d samples at >=1800 MHz, mean %.1f MHz (%.2f %% below 1980), %d below 1980, %d with the software power cap\n", c, n, s/n, (1-s/n/1980)*100, low, cap}'; done
