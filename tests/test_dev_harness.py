"""The development harness: the CPU harness is entered by the caller, and left as it was found.

Run in a process of its own each, so that no other test's harness or process group is in place:
`python -c`, forked by run_python from the test session's preloaded server (dev/forked_ranks.py),
which imported torch and megatron-core but never enters the harness (each child checks that first).
"""

import sys
import textwrap

import pytest

from harness.testing import run_python


def _python(code: str) -> str:
    proc = run_python([sys.executable, "-c", textwrap.dedent(code)], timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def test_cpu_harness_undoes_its_patches_and_keeps_an_outer_one():
    out = _python("""
        import torch
        from mixln_megatron import cpu
        assert not cpu.is_enabled()  # nothing of another test's harness in this process
        original = torch.cuda.current_device
        with cpu.harness():
            assert cpu.is_enabled() and torch.cuda.current_device() == torch.device("cpu")
            with cpu.harness():  # nested: the outer block owns the patches
                pass
            assert cpu.is_enabled()
        assert not cpu.is_enabled() and torch.cuda.current_device is original
        cpu.enable()
        with cpu.harness():
            pass
        assert cpu.is_enabled()  # a harness the caller put in place stays
        print("ok")
    """)
    assert out.strip() == "ok"


@pytest.mark.compat
def test_analysis_asks_for_the_harness_and_runs_inside_it():
    out = _python("""
        import torch
        from mixln_megatron.analysis.models import FreshShape, build_megatron_gpt
        from mixln_megatron import cpu
        assert not cpu.is_enabled()  # nothing of another test's harness in this process
        shape = FreshShape(num_layers=2, hidden_size=32, num_attention_heads=2, vocab_size=64, seq_length=8)
        try:
            build_megatron_gpt(shape, post_ln_layers=1)
        except RuntimeError as e:
            assert "cpu.harness()" in str(e), e
        else:
            raise AssertionError("the analysis patched the process itself")
        assert not cpu.is_enabled()
        with cpu.harness():
            lm = build_megatron_gpt(shape, post_ln_layers=1)
            ids = torch.randint(0, 64, (1, 8))
            assert lm.token_losses(ids, torch.roll(ids, -1, 1)).isfinite().all()
        assert not cpu.is_enabled()
        print("ok")
    """)
    assert out.strip().endswith("ok")
