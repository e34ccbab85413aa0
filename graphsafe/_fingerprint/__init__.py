"""`gs.fingerprint`: a digest of each tensor's dtype, shape and values (`digest`: its
definition and the public function), computed by the compiled kernel on a CPU
(`graphsafe/_native/fingerprint.cpp`), a Triton kernel on a GPU (`gpu`), or torch ops
(`torch_sums`)."""
