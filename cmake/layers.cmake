# Each layer exposes its own folder's headers and nothing else. Includes stay spelled from the
# project root ("runtime/log.h"), but the project root is on no include path: each folder gets a
# build-tree include root holding a single symlink, e.g.
#   build/layers/runtime/runtime -> <source>/runtime
# and a layer's library puts only that root on its include path. A target sees the roots of what
# it links, so runtime/ can include kernels/ but "zero/..." from runtime/ fails to compile.
# A symlink (not a copy) keeps every header, new ones included, the file being edited.

# zeroshard_layer_headers(<target> <PUBLIC|PRIVATE|INTERFACE> <folder>)
function(zeroshard_layer_headers target scope folder)
  string(REPLACE "/" "_" root_name "${folder}")
  set(root "${PROJECT_BINARY_DIR}/layers/${root_name}")
  get_filename_component(parent "${root}/${folder}" DIRECTORY)
  file(MAKE_DIRECTORY "${parent}")
  file(CREATE_LINK "${PROJECT_SOURCE_DIR}/${folder}" "${root}/${folder}" SYMBOLIC RESULT failed)
  if(failed)
    message(FATAL_ERROR "zeroshard: cannot create the include link ${root}/${folder} -> "
                        "${PROJECT_SOURCE_DIR}/${folder} (${failed}); the build folder must allow symlinks")
  endif()
  target_include_directories(${target} ${scope} "${root}")
endfunction()
