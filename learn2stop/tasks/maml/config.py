"""The MAML-stop config: where the tasks come from, the learner, the stages, the evaluation task sets, and the
presets (``quick``: task-imbalanced sinusoid regression, no data; ``paper``: Omniglot 20-way 1-5 shot)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from ...core import InferenceConfig, MethodConfig, StageConfig
from ...core.objectives import stage_field
from ...utils.config import ints_at_least, non_negative, one_of, positive, require
from ...utils.config_files import preset_config
from .learner import NETWORKS
from .policy import MAMLStopPolicy

SOURCES = ("sinusoid", "omniglot_npz", "omniglot_folders", "miniimagenet")


@dataclass
class DataConfig:
    """Which tasks: the source, its path, and the N-way k1-k2-shot setting."""

    source: str = "omniglot_npz"
    """sinusoid (embedded, no data) | omniglot_npz (background.npz + evaluation.npz) | omniglot_folders
    (images_background/ + images_evaluation/ PNGs) | miniimagenet (images/ + CSVs)."""
    path: str = "../shared/data/omniglot"
    """Folder of the data set (unused by sinusoid)."""
    split_file: str = ""
    """Omniglot character order (first 1100 train, 100 val, rest test); "" = path/maml_split.txt."""
    n_way: int = 20
    """Classes per task (N)."""
    k_min: int = 1
    """the task's shot count K ~ U{k_min..k_max}; equal values give the vanilla setting."""
    k_max: int = 5
    """the task's shot count K ~ U{k_min..k_max}; equal values give the vanilla setting."""
    query_per_class: int = 1
    """query examples per class (sinusoid: query points per task)."""
    rotations: bool = True
    """add every class rotated by 90/180/270 degrees as new classes (Omniglot)."""
    image_size: int = 28
    """Side in pixels to which images are resized (>= 16)."""
    noise: float = 0.0
    """sinusoid only, std of the noise on support targets."""

    def __post_init__(self):
        one_of(self.source, SOURCES, "source")
        ints_at_least(self, "k_min", "n_way", "query_per_class")
        if self.source != "sinusoid":  # one class is no classification: every label is 0 and the loss is 0
            require(self.n_way >= 2, "n_way", f"a few-shot task needs at least 2 classes; got {self.n_way}")
        require(isinstance(self.k_max, int) and self.k_max >= self.k_min, "k_max",
                f"must be an integer >= k_min = {self.k_min}; got {self.k_max!r}")
        ints_at_least(self, "image_size", least=16)
        require(self.noise >= 0, "noise", f"must be >= 0; got {self.noise}")
        if self.source != "sinusoid":
            require(self.path != "", "path", f"needed for source = {self.source}")


#: default bound on a task's inner gradient norm (ModelConfig.inner_grad_clip)
INNER_GRAD_CLIP = 10.0


@dataclass
class ModelConfig:
    """The learner and its inner loop."""

    network: str = "conv4"
    """The learner's architecture (conv4 for images, an MLP for sinusoid)."""
    hidden: int = 64
    """Channels (conv4) or hidden width (MLP) of the learner."""
    inner_steps: int = 10
    """T: inner gradient steps (the policy picks among steps 1..T)."""
    inner_lr: float = 0.1
    """Step size of the inner loop."""
    first_order: bool = False
    """First-order MAML: no gradient through the inner steps' gradients."""
    inner_grad_clip: float = INNER_GRAD_CLIP
    """bound on each task's inner gradient norm (see :class:`~learn2stop.tasks.maml.learner.MAMLModel`); it keeps the
    late inner steps from diverging when Stage I rarely trains them. 0 is the paper's unbounded step."""
    policy_posterior: bool = False
    """the stopping policy also reads each step's distance to a learned posterior-mean estimate of the query targets
    (:class:`~learn2stop.tasks.maml.policy.PosteriorPredictive`; regression only), trained alone in the ``posterior``
    stage and left as it is by Stage II; a stop then answers with the kept answer, the prediction of the step s <= t
    nearest that estimate (:class:`~learn2stop.tasks.maml.models.AnsweringMAML`, from Stage II on). Off by default
    (Omniglot, MiniImagenet); on in the quick (sinusoid) preset."""
    policy_inputs: str = "joint"
    """what the stopping policy reads besides its scalars (:class:`~learn2stop.tasks.maml.policy.MAMLStopPolicy`):
    ``"joint"`` (default) the DeepSets embeddings of the support and query sets, ``"scalars"`` none (the quick
    preset's: with the posterior-mean distances the sets add little, and the call is much cheaper without them). With ``policy_posterior`` and ``"scalars"`` the support
    loss the policy reads at step t is the one step t's inner gradient was taken of (the weights before the step),
    which costs nothing; otherwise that of step t's weights, a support-set forward at every step it reads."""

    def __post_init__(self):
        one_of(self.network, NETWORKS.names(), "network")
        one_of(self.policy_inputs, MAMLStopPolicy.INPUTS, "policy_inputs")
        require(isinstance(self.policy_posterior, bool), "policy_posterior", f"must be true or false; got {self.policy_posterior!r}")
        ints_at_least(self, "hidden", "inner_steps")
        positive(self.inner_lr, "inner_lr")
        non_negative(self.inner_grad_clip, "inner_grad_clip")


@dataclass
class EvalConfig:
    """Fixed task sets: ``tasks`` test tasks (the same for every method), ``val_tasks`` validation tasks
    (model selection and calibration), ``chunk`` tasks per forward. per_step: also run every step of
    both meta-learners (the fixed-depth and oracle rows); two more passes over the test tasks."""

    tasks: int = 600
    """Test tasks, the same for every method."""
    val_tasks: int = 100
    """Validation tasks (model selection and calibration)."""
    chunk: int = 20
    """Tasks per forward pass."""
    per_step: bool = True
    """Also run every step of both meta-learners (the fixed-depth and oracle rows): two more passes over the test tasks."""

    def __post_init__(self):
        ints_at_least(self, "tasks", "val_tasks", "chunk")


def _stage(**kw) -> Any:
    return stage_field(**{"batch_size": 10, "lr": 1e-3, "iterations": 60000, "eval_every": 500, "checkpoint_every": 500,
                          **kw})


@dataclass
class MAMLConfig:
    """MAML vs MAML-stop (paper Sec. 5.2). Defaults: Omniglot 20-way 1-5-shot, Table 4's setting."""

    #: only the test-time rule is read-only here: ``eval`` fixes the validation tasks training selects on
    reader_fields: ClassVar[tuple[str, ...]] = ("inference",)
    #: where the data lies: a reading command on a trained run may find it elsewhere (a moved folder, another machine)
    location_fields: ClassVar[tuple[str, ...]] = ("data.path", "data.split_file")

    seed: int = 0
    """Seed of training: initialisation and the training tasks."""
    data: DataConfig = field(default_factory=DataConfig)
    """Where the tasks come from, and the N-way K-shot setting."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The learner, its inner loop and the policy."""
    method: MethodConfig = field(default_factory=lambda: MethodConfig(beta=0.01))
    """beta (0.01 in the paper), depth prior and price on inner steps, inherited by every stage."""
    inference: InferenceConfig = field(default_factory=InferenceConfig)
    """the test-time stop rule (replaced by ``calibration.json`` once a run is calibrated)."""
    maml: StageConfig = _stage(objective="deep_supervision")
    """the baseline, trained on the query loss after all T inner steps (stage ``baseline``)."""
    stage1: StageConfig = _stage(objective="stage1", variant="sampled", recompute=True)
    """MAML-stop's meta-learner (sampled Stage I with the no-grad pass and recompute, App. B.2)."""
    posterior: StageConfig = _stage(objective="auxiliary", iterations=6000, batch_size=64, lr_schedule="step",
                                    lr_decay_at=(0.7,), eval_every=3000, checkpoint_every=1000)
    """with ``model.policy_posterior``, the policy's posterior-mean estimate alone (objective ``auxiliary``: regression
    on the query targets, no inner loop) on fresh training tasks, between Stage I and Stage II; without it the stage
    is not run."""
    stage2: StageConfig = _stage(objective="stage2", variant="map", iterations=5000)
    """the stopping policy fitted to the oracle with theta frozen (the estimate as its stage left it)."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """The fixed validation and test task sets."""

    def __post_init__(self):
        require(self.maml.objective == "deep_supervision", "maml.objective",
                f"the MAML baseline trains on the last step: must be deep_supervision; got {self.maml.objective!r}")
        require(self.stage1.objective == "stage1", "stage1.objective", f"must be stage1; got {self.stage1.objective!r}")
        require(self.posterior.objective == "auxiliary", "posterior.objective",
                f"the estimate trains alone: must be auxiliary; got {self.posterior.objective!r}")
        require(self.stage2.objective in ("stage2", "stage3"), "stage2.objective",
                f"must be stage2 (or stage3 to fine-tune both); got {self.stage2.objective!r}")
        require(self.model.inner_steps >= 2, "model.inner_steps", "a stopping policy needs T >= 2 steps")
        require(not self.model.policy_posterior or self.data.source == "sinusoid", "model.policy_posterior",
                f"the posterior-mean estimate is for regression (sinusoid) tasks; {self.data.source!r} is classification")
        want = "mlp" if self.data.source == "sinusoid" else "conv4"
        require(self.model.network == want, "model.network", f"{self.data.source} data needs the {want} network; "
                f"got {self.model.network!r}")


_ITERS = lambda n, b, every: {"iterations": n, "batch_size": b, "eval_every": every, "checkpoint_every": every}

PRESETS: dict[str, dict] = {
    # ~10 minutes on one CPU thread, no data: task-imbalanced sinusoid regression, 1-10 shots, noisy support.
    "quick": {
        "data": {"source": "sinusoid", "path": "", "n_way": 1, "k_min": 1, "k_max": 10, "query_per_class": 20,
                 "rotations": False, "noise": 1.0},
        # a stop answers with the step so far nearest a learned posterior-mean estimate (trained in its own stage);
        # the policy reads scalars alone (its distances to that estimate carry what the set embeddings did), the
        # support loss among them as the step's inner gradient computed it: an ask runs no support-set forward
        "model": {"network": "mlp", "hidden": 40, "inner_steps": 10, "inner_lr": 0.02, "policy_posterior": True,
                  "policy_inputs": "scalars"},
        "method": {"beta": 0.05, "price": 0.3},  # price: 10 inner steps cost 0.3 of query MSE
        "maml": {**_ITERS(3000, 25, 250), "lr": 1e-3},
        "stage1": {**_ITERS(3000, 25, 250), "lr": 1e-3},
        # reverse KL = E_q[loss] / beta - H(q): weights each task by what its stop step is worth
        "stage2": {**_ITERS(3000, 25, 250), "lr": 3e-3, "variant": "reverse_kl"},
        "eval": {"tasks": 600, "val_tasks": 1000, "chunk": 100},
    },
    # Table 4: Omniglot 20-way 1-5 shot (imbalanced), 10 inner steps, inner lr 0.1, meta-batch 10, outer lr 1e-3, beta 0.01.
    "paper": {},
    # The same setting from the standard PNG folders (path: a folder with images_background/ and images_evaluation/).
    "omniglot-folders": {"data": {"source": "omniglot_folders"}},
    # Table 5's vanilla setting: Omniglot 20-way 5-shot, fixed K.
    "omniglot-vanilla": {"data": {"k_min": 5, "k_max": 5}},
    # Table 4 on two CPU cores: Omniglot 20-way 1-5 shot (imbalanced), the paper's task protocol reduced to fit about 90
    # minutes at one thread: first-order, 5 inner steps at lr 0.4, meta-batch 4, 500 meta-iterations for MAML and for
    # Stage I (the same tasks seen by both; the paper: second-order, 10 steps at lr 0.1, 60k at meta-batch 10).
    "paper-cpu": {
        "model": {"first_order": True, "inner_steps": 5, "inner_lr": 0.4},
        "maml": _ITERS(500, 4, 250), "stage1": {**_ITERS(500, 4, 250), "recompute": False},
        "stage2": {**_ITERS(300, 4, 150), "lr": 1e-3},
    },
    # Table 5 on two CPU cores: Omniglot 5-way 1-shot (the paper's protocol: Conv4 64 filters, Finn et al.'s split,
    # 600 test tasks), reduced to fit about 50 minutes at one thread: first-order, 5 inner steps at lr 0.4, meta-batch
    # 8, 1800 meta-iterations per meta-learner (the paper: second-order, 60k at meta-batch 32); one query per class.
    "omniglot5-1shot-cpu": {
        "data": {"n_way": 5, "k_min": 1, "k_max": 1, "query_per_class": 1},
        "model": {"first_order": True, "inner_steps": 5, "inner_lr": 0.4},
        "maml": _ITERS(1800, 8, 300), "stage1": _ITERS(1800, 8, 300),
        "stage2": {**_ITERS(500, 8, 250), "lr": 1e-3},
    },
    # Table 5's 5-shot column: five times the support set, so 3 inner steps (the paper's vanilla runs vary 3-14),
    # meta-batch 4 and 1500 meta-iterations per meta-learner, about 50 minutes at one thread.
    "omniglot5-5shot-cpu": {
        "data": {"n_way": 5, "k_min": 5, "k_max": 5, "query_per_class": 1},
        "model": {"first_order": True, "inner_steps": 3, "inner_lr": 0.4},
        "maml": _ITERS(1500, 4, 300), "stage1": _ITERS(1500, 4, 300),
        "stage2": {**_ITERS(500, 4, 250), "lr": 1e-3},
    },
    # MiniImagenet 5-way 1-10 shot: 10 steps, inner lr 0.01, meta-batch 1, outer lr 1e-4, beta 0.01 (32 filters as in MAML).
    "miniimagenet": {
        "data": {"source": "miniimagenet", "path": "data/miniimagenet", "n_way": 5, "k_min": 1, "k_max": 10,
                 "query_per_class": 5, "rotations": False, "image_size": 84},
        "model": {"hidden": 32, "inner_lr": 0.01},
        "maml": {"batch_size": 1, "lr": 1e-4}, "stage1": {"batch_size": 1, "lr": 1e-4}, "stage2": {"batch_size": 1, "lr": 1e-4},
    },
}


def preset(name: str = "quick", **overrides: Any) -> MAMLConfig:
    """The config of a named preset, with optional nested overrides (dicts)."""
    return preset_config(MAMLConfig, PRESETS, name, "maml", **overrides)

