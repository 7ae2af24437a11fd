"""Training with Megatron-LM: the `mixln-megatron pretrain` entry point, Megatron-LM's argument
flags, and the gradient hooks (spike scaler, telemetry) installed on the finalize hook."""
