"""ActivationConfig validation and its Megatron/DeepSpeed-style flags (no processes)."""

import pytest

from hybrid.activation.apply import ActivationConfig
from hybrid.activation.recompute import partition_range
from hybrid.config_fields import ConfigError
from hybrid.job.cli import build_parser, parse_config


def parse(*argv):
    return parse_config(list(argv)).activation


def test_defaults_are_off():
    c = ActivationConfig()
    assert not (c.checkpoint_activations or c.partition_activations or c.checkpoint_in_cpu
                or c.contiguous_checkpointing)
    assert c.first_blocks is None and c.num_checkpointed(12) == 0


@pytest.mark.parametrize("field", ["partition_activations", "checkpoint_in_cpu",
                                   "contiguous_checkpointing"])
def test_options_need_checkpointing(field):
    with pytest.raises(ValueError, match=f"{field}=True needs checkpoint_activations=True"):
        ActivationConfig(**{field: True})


BLOCK = dict(recompute_granularity="full", recompute_method="block")


@pytest.mark.parametrize("bad", [0, -1, 2.5, True, "3"])
def test_bad_num_layers(bad):
    with pytest.raises(ValueError,
                       match=r"ActivationConfig.recompute_num_layers\): must be an integer >= 1"):
        ActivationConfig(**BLOCK, recompute_num_layers=bad)


def test_num_layers_needs_checkpointing_and_fits_model():
    with pytest.raises(ValueError,
                       match="--recompute-num-layers 2 needs --recompute-granularity full"):
        ActivationConfig(recompute_method="block", recompute_num_layers=2)
    c = ActivationConfig(**BLOCK, recompute_num_layers=2)
    assert c.checkpoint_activations and c.first_blocks == 2 and c.num_checkpointed(12) == 2
    with pytest.raises(ValueError, match="exceeds the model's num_layers=1"):
        c.validate(num_layers=1)
    assert ActivationConfig(checkpoint_activations=True).num_checkpointed(12) == 12


def test_flags():
    c = parse("--checkpoint-activations", "--partition-activations", "--checkpoint-in-cpu",
              "--contiguous-checkpointing", "--recompute-granularity", "full", "--recompute-method",
              "block", "--recompute-num-layers", "6")
    assert c == ActivationConfig(True, True, True, True, recompute_granularity="full",
                                 recompute_method="block", recompute_num_layers=6)
    assert (c.first_blocks, c.num_checkpointed(12)) == (6, 6)
    assert parse() == ActivationConfig()
    with pytest.raises(ConfigError, match="needs --checkpoint-activations"):
        parse("--partition-activations")
    with pytest.raises(ConfigError, match="add --partition-activations"):
        parse("--checkpoint-activations", "--checkpoint-in-cpu")
    helptext = " ".join(build_parser().format_help().split())
    assert ("1/tp slice of each checkpoint" in helptext
            and "only the first --recompute-num-layers blocks" in helptext)


@pytest.mark.parametrize("numel, parts", [(2048, 4), (7, 4), (7, 2), (3, 4), (5, 1)])
def test_partition_range_covers_every_element_once(numel, parts):
    covered = []
    for r in range(parts):
        chunk, start, real = partition_range(numel, parts, r)
        assert chunk * parts >= numel and 0 <= real <= chunk
        covered += range(start, start + real)
    assert covered == list(range(numel))


def test_recompute_granularity_and_sequence_parallel_flags():
    assert (parse("--recompute-granularity", "selective")
            == ActivationConfig(recompute_granularity="selective"))
    assert (parse("--recompute-granularity", "full")
            == ActivationConfig(recompute_granularity="full"))
    assert parse("--recompute-granularity", "full").checkpoint_activations
    with pytest.raises(ConfigError, match="selective and --checkpoint-activations"):
        parse("--recompute-granularity", "selective", "--checkpoint-activations")
    with pytest.raises(ValueError, match="are alternatives"):
        ActivationConfig(checkpoint_activations=True, recompute_granularity="selective")
    with pytest.raises(ConfigError, match="invalid choice: 'block'"):  # names the valid choices
        parse("--recompute-granularity", "block")
    from hybrid.job.config_checks import validate

    base = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--mock-data",
            "--vocab-size", "500", "--tensor-model-parallel-size", "4", "--sequence-parallel"]
    with pytest.raises(ConfigError,
                       match="--seq-length divisible by --tensor-model-parallel-size: 30 % 4 = 2"):
        validate(parse_config(base + ["--seq-length", "30"]), world_size=4, local_world_size=None)
    assert validate(parse_config(base + ["--seq-length", "32"]), world_size=4,
                    local_world_size=None).tp == 4
    assert "shard LayerNorm/dropout activations along the sequence" in build_parser().format_help()
