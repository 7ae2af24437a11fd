"""Development aids: the CPU/gloo harness (entered explicitly, e.g. by `pretrain --cpu`), the demo
and its plots."""
