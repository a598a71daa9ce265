"""What a deployment needs to know about a packaged recipe (:class:`DeployInfo`), and the names derived from it.

Shared by :mod:`kiln.triton.deploy.render`, :mod:`~kiln.triton.deploy.launch` and :mod:`~kiln.triton.deploy.k8s`
(which write the files) and :mod:`kiln.triton.deploy.validate` (which checks Kubernetes objects). See :mod:`kiln.triton.deploy` for the whole picture and the sources.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kiln.plan.host import PodSizing
from kiln.triton.deploy.openai_sidecar import OpenAISidecar, default_image
from kiln.util.errors import InputError

if TYPE_CHECKING:  # only for the annotation of DeployInfo.from_recipe
    from kiln.recipe.schema import Recipe

#: Where compose and Kubernetes mount the model repository inside the container.
CONTAINER_REPO = "/models"
#: The non-root user of the NGC tritonserver images (``triton-server``, uid/gid 1000).
RUN_AS_UID = 1000
#: Shared memory for NCCL and the Python backend (Docker's 64 MiB default is far too small).
SHM_SIZE_GIB = 4
#: Port the worker pods' ``sshd`` listens on (unprivileged: it runs as uid 1000).
SSH_PORT = 2222
#: How long a multi-node leader waits for its workers' sshd before giving up (seconds; env override).
WORKER_WAIT_S = 600
#: Longest name kiln gives a Kubernetes object. LeaderWorkerSet pods are ``<name>-<group>-<worker>`` and
#: their StatefulSets add a ``controller-revision-hash`` label ``<name>-<group>-<10 chars>``, which must
#: stay within 63 characters; 40 leaves room for suffixes such as ``-model-repo``.
NAME_MAX = 40

LWS_API_VERSION = "leaderworkerset.x-k8s.io/v1"
LWS_KIND = "LeaderWorkerSet"

_DNS1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_MODEL_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]*$")


#: Where the init step mounts the pod's repository volume (the repository is a folder in it, one per digest).
INIT_MOUNT = "/kiln-repo"
#: Where the registry Secret (kubernetes.io/dockerconfigjson) is mounted as the init step's Docker config.
REGISTRY_AUTH_MOUNT = "/etc/kiln-registry"


@dataclass(frozen=True)
class RepoPull:
    """The packaged repository as a remote-cache entry, and how the deploy files' init step fetches it."""

    cache: str
    """The remote cache, ``oci://HOST/REPOSITORY`` (``oci+http://`` for plain HTTP)."""
    tag: str
    """``package-<fingerprint>``."""
    digest: str
    """The entry's OCI manifest digest (computed locally; the deploy files pull by it)."""
    init_image: str
    registry_secret: str
    cache_pvc: str | None = None
    expect: tuple[str, ...] = ()
    """``FILE:KEY=VALUE`` facts the pulled repository must record (its versions against the serving image's)."""

    @property
    def folder(self) -> str:
        """The repository's folder in the volume: ``sha256-<hex>``."""
        return self.digest.replace(":", "-")

    def command(self) -> list[str]:
        argv = ["python3", "-m", "kiln.cache.fetch", "--cache", self.cache, "--tag", self.tag, "--digest",
                self.digest, "--into", f"{INIT_MOUNT}/{self.folder}"]
        for fact in self.expect:
            argv += ["--expect", fact]
        return argv


# ----------------------------------------------------------------------------------------- what to deploy


@dataclass(frozen=True)
class DeployInfo:
    """What the deployment files need to know about a packaged recipe.

    Attributes:
        recipe_name: The recipe's ``name``; Kubernetes names derive from it (:func:`k8s_name`).
        image: The serving container (``kiln.json``'s tag, e.g.
            ``nvcr.io/nvidia/tritonserver:26.07-trtllm-python-py3``).
        world_size: Ranks of the engine: ``parallelism.tp × parallelism.pp``.
        gpus_per_node: ``hardware.gpus_per_node``; a larger world size spans several nodes.
        http_port: ``serving.http_port``.
        grpc_port: ``serving.grpc_port``.
        metrics_port: ``serving.metrics_port``.
        gpu: False for ``target: reference`` (the CPU test and development vehicle): no GPU is reserved.
        hub_token_secret: Name of a Kubernetes Secret whose key ``HF_TOKEN`` is passed to the server as the
            ``HF_TOKEN`` variable (``secretKeyRef``; the value never appears in a file kiln writes).
        tensorrt_llm_model_names: Models ranks above 0 load in leader mode: ``tensorrt_llm`` plus the draft
            model's name for draft/target speculative decoding.
    """

    recipe_name: str
    image: str
    world_size: int
    gpus_per_node: int
    http_port: int
    grpc_port: int
    metrics_port: int
    gpu: bool
    hub_token_secret: str | None = None
    tensorrt_llm_model_names: tuple[str, ...] = ("tensorrt_llm",)
    orchestrator_gpus: int = 0
    """Draft+target with tp × pp > 1: TensorRT-LLM's orchestrator mode, one process spawning each model's ranks
    on this many GPUs of one node (0: leader mode)."""
    multinode_image: str | None = None
    """The image of multi-node (LeaderWorkerSet) pods: the serving image plus sshd (Dockerfile.multinode)."""
    openai: OpenAISidecar | None = None
    """kiln's OpenAI-compatible server beside Triton (:mod:`kiln.triton.deploy.openai_sidecar`); None: none."""
    llmapi: bool = False
    """Target pytorch: the repository's one model is Triton's llmapi model; one tritonserver process, whose LLM API
    starts the tp × pp ranks itself (no mpirun leader mode, no engine to check)."""
    repo_pull: RepoPull | None = None
    """The repository comes from the remote cache (init step); None: a volume the user fills (air-gapped)."""
    sizing: PodSizing | None = None
    """Host memory, /dev/shm, CPU and load time of a serving pod (:mod:`kiln.plan.host`); None: kiln's defaults."""

    def __post_init__(self) -> None:
        if not self.recipe_name.strip():
            raise InputError("deploy: the recipe name is empty; set `name` in the recipe")
        if not self.image.strip() or any(c.isspace() for c in self.image):
            raise InputError(f"deploy: {self.image!r} is not a container image reference (kiln.json `image`)")
        if self.world_size < 1:
            raise InputError(
                f"deploy: world size {self.world_size} < 1; parallelism.tp × parallelism.pp must be ≥ 1"
            )
        if self.gpus_per_node < 1:
            raise InputError(f"deploy: hardware.gpus_per_node is {self.gpus_per_node}; it must be ≥ 1")
        ports = {"serving.http_port": self.http_port, "serving.grpc_port": self.grpc_port,
                 "serving.metrics_port": self.metrics_port}
        for key, port in ports.items():
            if not 1 <= port <= 65_535:
                raise InputError(f"deploy: {key} is {port}; use a port between 1 and 65535")
        if self.openai is not None:
            ports["serving.openai_port"] = self.openai.port
        if len(set(ports.values())) != len(ports):
            raise InputError(
                f"deploy: {', '.join(ports)} must differ (got {', '.join(str(p) for p in ports.values())})"
            )
        if SSH_PORT in ports.values() and self.multi_node:
            raise InputError(
                f"deploy: port {SSH_PORT} is used by the multi-node workers' sshd; pick other serving.*_port values"
            )
        if not self.gpu and self.world_size != 1:
            raise InputError(
                "deploy: target: reference runs in one CPU process; set parallelism.tp and parallelism.pp to 1 "
                f"(their product is {self.world_size})"
            )
        if self.hub_token_secret is not None and not (
            len(self.hub_token_secret) <= 253 and _DNS1123_SUBDOMAIN.match(self.hub_token_secret)
        ):
            raise InputError(
                f"deploy: hub token secret {self.hub_token_secret!r} is not a valid Kubernetes Secret name "
                "(lower-case letters, digits, '-' and '.', at most 253 characters)"
            )
        if self.orchestrator_gpus and self.multi_node:
            raise InputError("deploy: draft+target decoding in orchestrator mode spawns its ranks on one node; "
                             "it cannot span several nodes (lower tp × pp, or raise hardware.gpus_per_node)")
        if not self.tensorrt_llm_model_names:
            raise InputError("deploy: no tensorrt_llm model names; ranks above 0 must load at least one model")
        for model in self.tensorrt_llm_model_names:
            if not _MODEL_NAME.match(model):
                raise InputError(f"deploy: {model!r} is not a Triton model directory name")

    @property
    def multi_node(self) -> bool:
        """True when the ranks do not fit on one node (Kubernetes then uses a LeaderWorkerSet)."""
        return self.world_size > self.gpus_per_node

    @property
    def pods_per_group(self) -> int:
        """Pods per LeaderWorkerSet group: ``ceil(world_size / gpus_per_node)`` (1 on a single node)."""
        return -(-self.world_size // self.gpus_per_node)

    @property
    def gpus_per_pod(self) -> int:
        """GPUs each pod reserves (0 for the reference target)."""
        if not self.gpu:
            return 0
        return self.gpus_per_node if self.multi_node else self.world_size

    @classmethod
    def from_recipe(
        cls,
        recipe: Recipe,
        image: str,
        *,
        hub_token_secret: str | None = None,
        draft_model_name: str | None = None,
        orchestrator: bool = False,
        orchestrator_gpus: int = 0,
        repo_pull: RepoPull | None = None,
        sizing: PodSizing | None = None,
    ) -> DeployInfo:
        """The deploy facts of ``recipe``: world size, GPUs per node, ports and target.

        ``draft_model_name`` is the draft model's directory in the repository (draft/target speculative
        decoding); ranks above 0 then load it too.
        """
        from kiln.recipe.schema import llmapi_runtime

        names = ("tensorrt_llm",) + ((draft_model_name,) if draft_model_name else ())
        s = recipe.serving
        llmapi = recipe.target == "pytorch"
        # the sidecar speaks to the ensemble / BLS; an llmapi repository has neither (trtllm-serve, whose files
        # package writes for target pytorch, is OpenAI-compatible itself)
        openai = (OpenAISidecar(s.openai_image or default_image(), s.openai_port, s.openai_model)
                  if s.openai_sidecar and not llmapi else None)
        return cls(
            recipe_name=recipe.name,
            image=image,
            world_size=recipe.parallelism.tp * recipe.parallelism.pp,
            gpus_per_node=recipe.hardware.gpus_per_node,
            http_port=recipe.serving.http_port,
            grpc_port=recipe.serving.grpc_port,
            metrics_port=recipe.serving.metrics_port,
            gpu=recipe.target == "tensorrt" or (llmapi and llmapi_runtime(recipe) == "tensorrt_llm"),
            hub_token_secret=hub_token_secret,
            tensorrt_llm_model_names=names,
            orchestrator_gpus=(orchestrator_gpus or recipe.parallelism.tp * recipe.parallelism.pp) if orchestrator else 0,
            multinode_image=recipe.serving.multinode_image or multinode_image_name(image),
            openai=openai,
            llmapi=llmapi,
            repo_pull=repo_pull,
            sizing=sizing,
        )


def multinode_image_name(image: str) -> str:
    """The local name ``Dockerfile.multinode``'s build command gives the derived multi-node image:
    ``kiln-trtllm-multinode:<serving tag>`` (push it to your registry and set serving.multinode_image)."""
    tag = image.split("@", 1)[0].rsplit("/", 1)[-1].split(":", 1)
    return f"kiln-trtllm-multinode:{tag[1] if len(tag) == 2 else 'latest'}"


def k8s_name(recipe_name: str) -> str:
    """A Kubernetes object name for ``recipe_name``: a DNS-1035 label (so valid for Services too) of at most
    :data:`NAME_MAX` characters. ``.``/``_`` become ``-``; a name not starting with a letter gets ``kiln-``
    in front; a long name is cut and ends in 8 hex digits of its hash, so distinct recipes stay distinct."""
    base = re.sub(r"[^a-z0-9]+", "-", recipe_name.lower()).strip("-")
    if not base or not base[0].isalpha():
        base = f"kiln-{base}".rstrip("-")
    if len(base) > NAME_MAX:
        digest = hashlib.sha256(recipe_name.encode()).hexdigest()[:8]
        base = f"{base[: NAME_MAX - len(digest) - 1].rstrip('-')}-{digest}"
    return base



#: Vocabulary assumed for the tokenizer's host memory when the model's config cannot be read (Llama 3's size).
FALLBACK_VOCAB = 128_256


def sizing_for(recipe: Recipe, model_config: dict | None = None, repo_bytes: int = 0) -> PodSizing:
    """A serving pod's figures for ``recipe`` (:func:`kiln.plan.host.pod_sizing`): weights from the planner on the
    model's config (read without a download: local, built-in, or shipped with kiln), else from ``repo_bytes`` (the
    packaged repository, measured) split evenly over the ranks."""
    from kiln.plan.errors import PlanError
    from kiln.plan.host import pod_sizing
    from kiln.plan.model import parse_model_config
    from kiln.plan.planner import weight_bytes
    from kiln.plan.recipe import plan_inputs, recipe_model_config
    from kiln.recipe.loader import LoadedRecipe

    world = recipe.parallelism.tp * recipe.parallelism.pp
    per_pod = min(world, recipe.hardware.gpus_per_node)
    llmapi = recipe.target == "pytorch"
    config = model_config if model_config is not None else recipe_model_config(LoadedRecipe(recipe, None))
    try:
        if config is None:
            raise PlanError("no model config")
        total, rank = weight_bytes(plan_inputs(recipe, config))
        vocab = parse_model_config(config).vocab_size
        basis = (f"weights from the planner ({recipe.model.source}, {recipe.quantization.format}, tp {recipe.parallelism.tp}"
                 f" × pp {recipe.parallelism.pp})")
    except PlanError as exc:
        total, rank, vocab = repo_bytes, -(-repo_bytes // world), FALLBACK_VOCAB
        basis = f"weights measured in the packaged repository ({exc}); vocabulary assumed {FALLBACK_VOCAB}"
    return pod_sizing(rank_weight_bytes=rank, total_weight_bytes=max(total, repo_bytes), ranks_on_pod=per_pod,
                      gpus_on_pod=per_pod, vocab_size=vocab, python_models=1 if llmapi else 3,
                      tokenizer_loads=1 if llmapi else 2, basis=basis)
