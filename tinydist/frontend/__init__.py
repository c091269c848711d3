"""The frontend: what users write — `Tensor` with numpy semantics over the lazy graph (tensor),
compound ops (functional), gradients built as graph (autograd) and `td.jit`, which captures a
function once and replays it through the engine (jit). `tinydist` re-exports the public names."""
