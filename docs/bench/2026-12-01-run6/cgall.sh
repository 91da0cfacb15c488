#!/usr/bin/env bash
cd /work/main
for b in head new; do echo "== broadcast $b $(date -u +%T)"; OUT=/tmp/cg-$b scripts/bench/callgrind broadcast /tmp/exp/posthorn-$b; done
for b in head new; do echo "== storm $b $(date -u +%T)"; OUT=/tmp/cgs-$b scripts/bench/callgrind storm /tmp/exp/posthorn-$b; done
for b in head new; do echo "== cache broadcast 10000 $b $(date -u +%T)"; N=10000 RATE=0.5 CACHE=1 OUT=/tmp/cgc-$b scripts/bench/callgrind broadcast /tmp/exp/posthorn-$b; done
for b in head new; do echo "== broadcast repeat $b $(date -u +%T)"; OUT=/tmp/cgr-$b scripts/bench/callgrind broadcast /tmp/exp/posthorn-$b; done
echo "== done $(date -u +%T)"
