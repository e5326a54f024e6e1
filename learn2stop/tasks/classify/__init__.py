"""Early-exit image recognition (paper Sec. 5.4): VGG and ResNets with internal classifiers, SDN vs Stage I + policy."""
from .app import APP, PRESETS, ClassifyConfig, evaluate, predict, reproduce, synthetic_set, train  # noqa: F401
from .data import ImageDataError, ImageSet, load_dataset, load_image_file  # noqa: F401
from .models import ARCHS, VGG, ResNet, build_network, list_archs  # noqa: F401
