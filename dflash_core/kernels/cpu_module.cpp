// The extension module of this project's CPU primitives (built by cpu_extension.py).

#include "cpu_kernels.h"

NB_MODULE(MODULE_NAME, m) {
  nb::module_::import_("mlx.core");
  dflash::add_linear(m);
  dflash::add_softmax(m);
  dflash::add_attention(m);
}
