# What mcf.get_include() ships: this tree holds nothing but mcf's C-level surface, so a build that adds it to
# an include path adds nothing else (the directory above the package would add all of site-packages).  The
# declarations are the compiled module's own (mcf/_core/_io.pxd), included, so they cannot drift apart.
include "../../../_core/_io.pxd"
