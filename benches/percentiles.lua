-- wrk script: print latency percentiles in microseconds, one per line, for the bench harness.
done = function(summary, latency, requests)
    io.write(string.format("BENCH requests=%d errors=%d p50=%d p99=%d p999=%d\n",
        summary.requests,
        summary.errors.connect + summary.errors.read + summary.errors.write + summary.errors.status + summary.errors.timeout,
        latency:percentile(50), latency:percentile(99), latency:percentile(99.9)))
end
