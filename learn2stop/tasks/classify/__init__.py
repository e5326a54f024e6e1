"""Early-exit image recognition (paper Sec. 5.4): VGG and ResNets with internal classifiers, SDN vs Stage I + policy.

Laid out as every task is: :mod:`.config` (dataclasses and presets), :mod:`.data` (the loaders, the images of a run
and the training task; with :mod:`.imageset`, :mod:`.cifar` and :mod:`.folders`), :mod:`.models` (the networks,
exits attached), :mod:`.metric`, :mod:`.report`, :mod:`.app` (the :class:`~learn2stop.core.task.StoppingApp`) and
:mod:`.commands` (the commands and the task's registration). The stopping policy is the core's
:class:`~learn2stop.core.policies.ExitPolicy`, so there is no ``policy`` module.
"""
from .app import APP  # noqa: F401
from .commands import SPEC, evaluate, predict, reproduce, train  # noqa: F401
from .config import PRESETS, ClassifyConfig  # noqa: F401
from .data import ImageDataError, ImageSet, load_dataset, load_image_file, synthetic_set  # noqa: F401
from .models import ARCHS, VGG, ResNet, build_network, list_archs  # noqa: F401
