# The trainer's statements keep their shapes, so its style is kept too:
# ruff: noqa: B028, E501, RUF005, SIM102, SIM210, SIM211
"""The LLM trainer's strategy block runs unchanged on jfleet (issue 12).

Mirrors PaddleNLP's ``paddlenlp/trainer/training_args.py``, ``TrainingArguments.__post_init__``
(develop, 2024-2025, the version with ``hybrid_parallel_topo_order`` and
``enable_sp_async_reduce_scatter``): from ``world_size = paddle.distributed.get_world_size()``
through the ``if self.use_hybrid_parallel:`` branch to ``fleet.init(is_collective=True,
strategy=strategy)``. The statements below are written again here with the same shapes
and names: the attribute and item writes on nested sections, the ``try`` / ``except
(KeyError, AttributeError)`` and bare ``except`` patterns, the order lists,
``is_segment_parallel_supported`` and its four-axis fallback. Changed:
``from paddle.distributed import fleet`` -> ``from jfleet import fleet``; the Paddle calls
outside fleet (``paddle.distributed.get_world_size()``,
``parallel_helper._is_parallel_ctx_initialized()``) and the trainer's own helpers
(``split_parallel_config``, ``ShardingOption``, ``logger``) are small stand-ins; the
dataclass fields are an ``Args`` stand-in; branches for features the three runs do not
set (auto parallel, expert parallel, eval batch sizes) are left out.
"""

from __future__ import annotations

import inspect
import logging
import warnings
from enum import Enum

import jax

from jfleet import fleet  # was: from paddle.distributed import fleet

logger = logging.getLogger("paddlenlp")


class ShardingOption(Enum):  # paddlenlp.trainer.trainer_utils.ShardingOption
    SHARD_OP = "stage1"
    SHARD_GRAD_OP = "stage2"
    FULL_SHARD = "stage3"
    OFFLOAD = "offload"


def split_parallel_config(parallel_config):  # paddlenlp.trainer.training_args
    if "," in parallel_config:
        return set(parallel_config.split(","))
    return set(parallel_config.split(" "))


class Args:
    """The ``TrainingArguments`` fields the strategy block reads, with the trainer's defaults."""

    def __init__(self, **fields):
        self.sharding = ""
        self.sharding_parallel_degree = -1
        self.tensor_parallel_degree = -1
        self.pipeline_parallel_degree = -1
        self.sep_parallel_degree = -1
        self.context_parallel_degree = -1
        self.sharding_parallel_config = ""
        self.pipeline_parallel_config = ""
        self.tensor_parallel_config = ""
        self.data_parallel_config = ""
        self.hybrid_parallel_topo_order = None
        self.sharding_comm_buffer_size_MB = -1
        self.gradient_accumulation_steps = 1
        self.per_device_train_batch_size = 8
        self.per_device_eval_batch_size = 8
        self.amp_master_grad = False
        self.sequence_parallel = False
        self.release_grads = False
        self.use_expert_parallel = False
        self.do_eval = False
        self.logging_steps = 10
        self.seed = 42
        self.__dict__.update(fields)

    def post_init(self):
        """The strategy set-up of ``TrainingArguments.__post_init__``, statement by statement."""
        if isinstance(self.sharding, str):
            self.sharding = [ShardingOption(s) for s in self.sharding.split()]
        self.data_parallel_degree = 1
        self.use_hybrid_parallel = False

        world_size = len(jax.devices())  # was: paddle.distributed.get_world_size()

        if world_size > 1:
            tensor_parallel_degree = max(self.tensor_parallel_degree, 1)
            sep_parallel_degree = max(self.sep_parallel_degree, 1)
            context_parallel_degree = max(self.context_parallel_degree, 1)
            pipeline_parallel_degree = max(self.pipeline_parallel_degree, 1)

            assert world_size % (self.tensor_parallel_degree * self.pipeline_parallel_degree) == 0

            if self.sharding_parallel_degree == -1:
                if len(self.sharding) > 0:
                    self.sharding_parallel_degree = world_size // (
                        tensor_parallel_degree
                        * sep_parallel_degree
                        * context_parallel_degree
                        * pipeline_parallel_degree
                    )

            sharding_parallel_degree = max(self.sharding_parallel_degree, 1)
            if sharding_parallel_degree == 1 and len(self.sharding) > 0:
                logger.warning(
                    "sharding_parallel_degree=1 means no sharding, please set sharding to empty!"
                )
                self.sharding = []

            self.data_parallel_degree = world_size // (
                sharding_parallel_degree
                * tensor_parallel_degree
                * sep_parallel_degree
                * context_parallel_degree
                * pipeline_parallel_degree
            )

            if (
                sharding_parallel_degree > 1
                or tensor_parallel_degree > 1
                or pipeline_parallel_degree > 1
                or self.sep_parallel_degree > 1
                or self.context_parallel_degree > 1
            ):
                self.use_hybrid_parallel = True
                self.sharding_parallel_degree = sharding_parallel_degree
                self.tensor_parallel_degree = tensor_parallel_degree
                self.pipeline_parallel_degree = pipeline_parallel_degree
                self.sep_parallel_degree = sep_parallel_degree
                self.context_parallel_degree = context_parallel_degree

        if self.hybrid_parallel_topo_order is None:
            self.hybrid_parallel_topo_order = "pp_first"
        assert self.hybrid_parallel_topo_order in ["pp_first", "sharding_first"]

        if self.use_hybrid_parallel:
            if self.pipeline_parallel_degree > 1:
                if (
                    ShardingOption.FULL_SHARD in self.sharding
                    or ShardingOption.SHARD_GRAD_OP in self.sharding
                ):
                    raise ValueError(
                        "pipeline parallel is not compatible for sharding stage2 or stage3"
                    )

            if not False:  # was: not parallel_helper._is_parallel_ctx_initialized()
                strategy = fleet.DistributedStrategy()
                assert self.data_parallel_config == "", (
                    "data_parallle_config is not supported in hybrid parallel"
                )
                if self.pipeline_parallel_degree > 1:
                    pipeline_parallel_config = split_parallel_config(self.pipeline_parallel_config)
                    for x in pipeline_parallel_config:
                        if len(x) > 0:
                            if x not in [
                                "disable_p2p_cache_shape",
                                "disable_partial_send_recv",
                                "enable_delay_scale_loss",
                                "enable_dp_comm_overlap",
                                "enable_sharding_comm_overlap",
                                "enable_timer",
                                "enable_release_grads",
                                "enable_dp_comm_overlap",
                                "enable_clear_every_step_cache",
                                "enable_overlap_p2p_comm",
                                "disable_batch_p2p_comm",
                                "best_unbalanced_scheduler",
                            ]:
                                raise ValueError(f"Found unknown pipeline mode config {x}")

                    enable_partial_send_recv = (
                        "disable_partial_send_recv" not in pipeline_parallel_config
                    )
                    if self.sequence_parallel and enable_partial_send_recv:
                        enable_partial_send_recv = False

                    strategy.pipeline_configs = {
                        "accumulate_steps": self.gradient_accumulation_steps,
                        "micro_batch_size": self.per_device_train_batch_size,
                        "enable_partial_send_recv": enable_partial_send_recv,
                        "p2p_cache_shape": False
                        if "disable_p2p_cache_shape" in pipeline_parallel_config
                        else True,
                    }
                    logger.info(
                        f"PP configs:{strategy.pipeline_configs}, use master_grad: {self.amp_master_grad}"
                    )

                    using_comm_overlap = (
                        "enable_sharding_comm_overlap" in pipeline_parallel_config
                        or "enable_dp_comm_overlap" in pipeline_parallel_config
                    )
                    enable_dp_comm_overlap = using_comm_overlap and self.data_parallel_degree > 1
                    self.enable_sharding_comm_overlap = (
                        using_comm_overlap and self.sharding_parallel_degree > 1
                    )
                    assert not (enable_dp_comm_overlap and self.enable_sharding_comm_overlap)

                    if self.enable_sharding_comm_overlap and not self.amp_master_grad:
                        raise ValueError(
                            "If `enable_sharding_comm_overlap`, `amp_master_grad` must be True."
                        )

                    dygraph_pp_configs = {
                        "delay_scale_loss": True
                        if "enable_delay_scale_loss" in pipeline_parallel_config
                        else False,
                        "dp_comm_overlap": enable_dp_comm_overlap,
                        "sharding_comm_overlap": self.enable_sharding_comm_overlap,
                        "enable_timer": "enable_timer" in pipeline_parallel_config,
                        "release_gradients": "enable_release_grads" in pipeline_parallel_config
                        or self.release_grads,
                        "overlap_p2p_comm": "enable_overlap_p2p_comm" in pipeline_parallel_config,
                        "clear_every_step_cache": "enable_clear_every_step_cache"
                        in pipeline_parallel_config,
                        "use_batch_p2p_comm": "disable_batch_p2p_comm"
                        not in pipeline_parallel_config,
                        "best_unbalanced_scheduler": "best_unbalanced_scheduler"
                        in pipeline_parallel_config,
                    }
                    if dygraph_pp_configs["dp_comm_overlap"]:
                        raise ValueError("overlap has accuracy issue")

                if self.tensor_parallel_degree > 1:
                    strategy.tensor_parallel_configs = {"tensor_init_seed": self.seed}

                    mp_config = split_parallel_config(self.tensor_parallel_config)

                    for x in mp_config:
                        if len(x) > 0:
                            if x not in [
                                "enable_mp_async_allreduce",
                                "enable_mp_skip_c_identity",
                                "enable_mp_fused_linear_param_grad_add",
                                "enable_sp_async_reduce_scatter",
                                "enable_delay_scale_loss",
                                "sync_param",
                                "sync_grad",
                                "sync_moment",
                            ]:
                                raise ValueError(f"Found unknown tensor parallell config {x}")
                    try:
                        if "enable_mp_async_allreduce" in mp_config:
                            strategy.hybrid_configs["mp_configs"].mp_async_allreduce = True
                            if "enable_mp_skip_c_identity" in mp_config:
                                strategy.hybrid_configs["mp_configs"].mp_skip_c_identity = True
                            if "enable_mp_fused_linear_param_grad_add" in mp_config:
                                strategy.hybrid_configs[
                                    "mp_configs"
                                ].mp_fused_linear_param_grad_add = True
                        else:
                            if "enable_mp_skip_c_identity" in mp_config:
                                warnings.warn(
                                    "enable_mp_skip_c_identity only works with enable_mp_async_allreduce."
                                )
                            if "enable_mp_fused_linear_param_grad_add" in mp_config:
                                warnings.warn(
                                    "enable_mp_fused_linear_param_grad_add only works with ..."
                                )
                        if "enable_sp_async_reduce_scatter" in mp_config:
                            strategy.hybrid_configs["mp_configs"].sp_async_reduce_scatter = True

                        sync_param = "sync_param" in mp_config
                        sync_grad = "sync_grad" in mp_config
                        sync_moment = "sync_moment" in mp_config

                        if sync_param or sync_grad or sync_moment:
                            logger.info("setting sync_param_name")
                            strategy.sync_param_name = [""]

                        if sync_param:
                            logger.info("setting sync_param")
                            strategy.hybrid_configs["mp_configs"].sync_param = True

                        if sync_grad:
                            logger.info("setting sync_grad")
                            strategy.hybrid_configs["mp_configs"].sync_grad = True

                        if sync_moment:
                            logger.info("setting sync_moment")
                            strategy.hybrid_configs["mp_configs"].sync_moment = True

                    except:  # noqa: E722 (as the trainer writes it)
                        warnings.warn("The enable_mp_async_allreduce, ... are not supported.")

                def is_segment_parallel_supported():
                    members = [
                        name for (name, date) in inspect.getmembers(fleet.HybridCommunicateGroup)
                    ]
                    support_sep = "get_sep_parallel_world_size" in members
                    if not support_sep:
                        logger.warning("segment parallel is not supported!!!, Ignore it.")
                    return support_sep

                if self.hybrid_parallel_topo_order == "pp_first":
                    if is_segment_parallel_supported():
                        order = ["dp", "pp", "sharding", "sep", "mp"]
                    else:
                        order = ["dp", "pp", "sharding", "mp"]
                if self.hybrid_parallel_topo_order == "sharding_first":
                    if is_segment_parallel_supported():
                        order = ["dp", "sharding", "pp", "sep", "mp"]
                    else:
                        order = ["dp", "sharding", "pp", "mp"]
                if self.use_expert_parallel:
                    order = order[1:-1] + ["dp", "mp"]

                if is_segment_parallel_supported():
                    hybrid_configs = {
                        "dp_degree": self.data_parallel_degree,
                        "mp_degree": self.tensor_parallel_degree,
                        "pp_degree": self.pipeline_parallel_degree,
                        "sharding_degree": self.sharding_parallel_degree,
                        "sep_degree": self.sep_parallel_degree
                        if self.sep_parallel_degree > 1
                        else self.context_parallel_degree,
                        "order": order,
                    }
                else:
                    hybrid_configs = {
                        "dp_degree": self.data_parallel_degree,
                        "mp_degree": self.tensor_parallel_degree,
                        "pp_degree": self.pipeline_parallel_degree,
                        "sharding_degree": self.sharding_parallel_degree,
                        "order": order,
                    }

                if self.pipeline_parallel_degree > 1:
                    hybrid_configs["pp_configs"] = dygraph_pp_configs
                    logger.info(f"using pipeline configs:{dygraph_pp_configs}")

                strategy.hybrid_configs = hybrid_configs

                if self.sharding_parallel_degree > 1:
                    sharding_parallel_config = split_parallel_config(self.sharding_parallel_config)

                    for x in sharding_parallel_config:
                        if len(x) > 0:
                            if x not in [
                                "enable_stage1_tensor_fusion",
                                "enable_stage1_overlap",
                                "enable_stage2_overlap",
                                "split_param",
                                "disable_stage1_reduce_avg",
                                "enable_stage1_broadcast_overlap",
                                "enable_stage1_allgather_overlap",
                                "enable_release_grads",
                            ]:
                                raise ValueError(f"Found unknown pipeline mode config {x}")
                    if "disable_stage1_reduce_avg" in sharding_parallel_config:
                        assert self.sharding == [ShardingOption.SHARD_OP]
                        try:
                            strategy.hybrid_configs["sharding_configs"].use_reduce_avg = False
                        except:  # noqa: E722 (as the trainer writes it)
                            warnings.warn(
                                "The reduce_avg strategy is not supported by current version of Paddle."
                            )

                    try:
                        if self.sharding_comm_buffer_size_MB > 0:
                            strategy.hybrid_configs["sharding_configs"].comm_buffer_size_MB = int(
                                self.sharding_comm_buffer_size_MB
                            )

                        if "split_param" in sharding_parallel_config:
                            strategy.hybrid_configs["sharding_configs"].split_param = True
                            assert self.amp_master_grad, (
                                "Currently sharding stage1 v2 only support amp_master_grad"
                            )

                        if "enable_release_grads" in sharding_parallel_config:
                            strategy.hybrid_configs["sharding_configs"].release_gradients = True

                        if self.pipeline_parallel_degree == 1:
                            strategy.hybrid_configs["sharding_configs"].tensor_fusion = (
                                True
                                if "enable_stage1_tensor_fusion" in sharding_parallel_config
                                else False
                            )
                            if "enable_stage1_overlap" in sharding_parallel_config:
                                strategy.hybrid_configs["sharding_configs"].comm_overlap = True
                                strategy.hybrid_configs[
                                    "sharding_configs"
                                ].accumulate_steps = self.gradient_accumulation_steps

                        else:
                            warnings.warn(
                                "For pipeline parallel with sharding, the sharding overlap and tensor fusion "
                                "should be configured in pipeline_parallel_config."
                            )
                    except (KeyError, AttributeError):
                        warnings.warn(
                            "The enable_stage1_tensor_fusion or enable_stage1_overlap is not supported."
                        )

                fleet.init(is_collective=True, strategy=strategy)
                logger.info(strategy)
                self.strategy = strategy


# --------------------------------------------------------------------------- the runs
def _degrees():
    hcg = fleet.get_hybrid_communicate_group()
    return {
        "dp": hcg.get_data_parallel_world_size(),
        "pp": hcg.get_pipe_parallel_world_size(),
        "sharding": hcg.get_sharding_parallel_world_size(),
        "sep": hcg.get_sep_parallel_world_size(),
        "mp": hcg.get_model_parallel_world_size(),
    }


def test_sharding_with_pp1_dp2_sharding4(caplog):
    args = Args(
        sharding="stage1",
        sharding_parallel_degree=4,
        sharding_parallel_config="enable_stage1_tensor_fusion enable_stage1_overlap split_param "
        "enable_release_grads disable_stage1_reduce_avg",
        sharding_comm_buffer_size_MB=128,
        gradient_accumulation_steps=4,
        amp_master_grad=True,
    )
    with caplog.at_level(logging.INFO, logger="jfleet"), warnings.catch_warnings():
        warnings.simplefilter("error")  # no "not supported by current version" fallback
        args.post_init()
    assert _degrees() == {"dp": 2, "pp": 1, "sharding": 4, "sep": 1, "mp": 1}
    sharding = args.strategy.to_dict()["hybrid_configs"]["sharding_configs"]
    assert {k: sharding[k] for k in ("tensor_fusion", "comm_overlap", "split_param")} == {
        "tensor_fusion": True,
        "comm_overlap": True,
        "split_param": True,
    }
    assert sharding["accumulate_steps"] == 4 and sharding["comm_buffer_size_MB"] == 128
    assert sharding["use_reduce_avg"] is False and sharding["release_gradients"] is True
    # The sharding flags are SPMD no-ops: fleet.init logs them with the reason.
    assert "hybrid_configs.sharding_configs.tensor_fusion" in caplog.text
    # The order: dp outside sharding, so each sharding group is 4 consecutive ranks.
    assert fleet.get_hybrid_parallel_topology().get_comm_list("sharding")[0] == [0, 1, 2, 3]


def test_tp2_pp2_sharding2():
    args = Args(
        sharding="stage1",
        sharding_parallel_degree=2,
        tensor_parallel_degree=2,
        pipeline_parallel_degree=2,
        pipeline_parallel_config="enable_delay_scale_loss enable_sharding_comm_overlap "
        "disable_p2p_cache_shape",
        tensor_parallel_config="enable_mp_async_allreduce enable_mp_skip_c_identity sync_param",
        sharding_parallel_config="enable_stage1_tensor_fusion",
        per_device_train_batch_size=1,
        gradient_accumulation_steps=4,
        amp_master_grad=True,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        args.post_init()
    # Only the trainer's own warning for sharding options under pp; no "not supported".
    # The trainer's own: the port above (others, e.g. an earlier test's unclosed socket's
    # ResourceWarning, arrive whenever the collector runs).
    caught = [w for w in caught if w.filename == __file__]
    assert len(caught) == 1, [str(w.message) for w in caught]
    assert str(caught[0].message).startswith("For pipeline parallel with sharding")
    assert _degrees() == {"dp": 1, "pp": 2, "sharding": 2, "sep": 1, "mp": 2}
    values = args.strategy.to_dict()
    hybrid = values["hybrid_configs"]
    assert hybrid["order"] == ["dp", "pp", "sharding", "sep", "mp"]
    assert hybrid["pp_configs"]["delay_scale_loss"] is True
    assert hybrid["pp_configs"]["sharding_comm_overlap"] is True
    assert hybrid["mp_configs"]["mp_async_allreduce"] is True
    assert hybrid["mp_configs"]["mp_skip_c_identity"] is True
    assert hybrid["mp_configs"]["sync_param_name"] == [""]
    assert values["pipeline_configs"]["accumulate_steps"] == 4
    assert values["pipeline_configs"]["micro_batch_size"] == 1
    assert values["pipeline_configs"]["p2p_cache_shape"] is False
    assert values["tensor_parallel_configs"]["tensor_init_seed"] == 42
    topology = fleet.get_hybrid_parallel_topology()
    assert topology.get_comm_list("model")[0] == [0, 1]  # mp innermost
    assert topology.get_comm_list("pipe")[0] == [0, 4]  # pp outside sharding and mp


def test_older_four_axis_order(monkeypatch):
    # On a Paddle without the sep axis (HybridCommunicateGroup has no
    # get_sep_parallel_world_size) the trainer writes the four-axis order.
    older = {
        name: value
        for name, value in vars(fleet.HybridCommunicateGroup).items()
        if name != "get_sep_parallel_world_size"
    }
    monkeypatch.setattr(fleet, "HybridCommunicateGroup", type("HybridCommunicateGroup", (), older))
    args = Args(tensor_parallel_degree=2, pipeline_parallel_degree=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        args.post_init()
    assert args.strategy.hybrid_configs["order"] == ["dp", "pp", "sharding", "sep", "mp"]
    monkeypatch.undo()
    assert _degrees() == {"dp": 2, "pp": 2, "sharding": 1, "sep": 1, "mp": 2}
    topology = fleet.get_hybrid_parallel_topology()
    # Ranks as Paddle lays out ["dp", "pp", "sharding", "mp"] on 8 devices: mp innermost.
    assert topology.get_comm_list("model")[:2] == [[0, 1], [2, 3]]
    assert topology.get_comm_list("pipe")[0] == [0, 2]
    assert topology.get_comm_list("data")[0] == [0, 4]
