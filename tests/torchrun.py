"""Launch a worker script under torchrun (gloo, CPU) from a test."""

import os
import subprocess
import sys



def torchrun(script, nproc, *args, timeout=600, env=None):
    run_env = {k: v for k, v in os.environ.items() if not k.startswith("MIXLN_")}
    run_env.update(env or {})
    # --standalone: torchrun binds its rendezvous to a port the OS picks (no free-port race).
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           script, *map(str, args)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=run_env)
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}")
    return proc
