"""KVX ops: the dispatcher (`ops.dispatch`, public as `kvx_core.write_kv` etc.), the torch reference
(`ops.reference`, `ops.attention`) and the GPU kernels. Import the submodule you mean: the package itself
exports no op, so there is one public name per op."""
