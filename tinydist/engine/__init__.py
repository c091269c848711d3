"""The engine: running schedules and replaying captured ones.

The layer between the schedule (what to run, in which order, in which memory) and the frontend
(Tensors, `td.jit`). `realize` runs a schedule once; a `Capture` binds one once and replays it by
the strategy that fits. Both lower each schedule item to runtime commands in one place
(`commands`) and bind buffers with one binder (`binding`).

    commands   schedule item → runtime commands (Launch, Copy), the one lowering
    binding    schedule + inputs + owned arguments → bound buffers, rolled back on failure
    realize    run a schedule: bind, submit batches, hand results to the graph
    lowered    a cached schedule lowered once: realize fills in addresses, kernels linked per batch
    capture    a captured graph: bound once, replayed by a strategy
    replay     the strategies: entry point, native streams, runs, host frame
    streams    native streams: one native call per queue, cross-queue waits baked at capture
"""
