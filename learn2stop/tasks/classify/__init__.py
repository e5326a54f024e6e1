"""Early-exit image recognition (paper Sec. 5.4): VGG with internal classifiers, SDN vs Stage I + policy."""
from .app import APP, PRESETS, ClassifyConfig, evaluate, predict, reproduce, synthetic_set, train  # noqa: F401
from .data import ImageDataError, ImageSet, load_dataset, load_image_file  # noqa: F401
from .models import VGGEarlyExit, build_vgg, exit_flops, full_network_flops, step_flops  # noqa: F401
from .policy import ExitPolicy  # noqa: F401
