# Finds LibTorch through the Python interpreter that has torch, so the C++ API matches the wheel.
# Exposes two targets instead of Torch's catch-all TORCH_LIBRARIES:
#   zeroshard::aten          ATen / c10 / c10d (torch_cpu), for runtime/ zero/ offload/ pipeline/
#   zeroshard::torch_python  the above plus libtorch_python and pybind11, for python/csrc only
find_package(Python3 REQUIRED COMPONENTS Interpreter Development.Module)
execute_process(
  COMMAND "${Python3_EXECUTABLE}" -c
          "import torch, os; print(torch.utils.cmake_prefix_path); print(os.path.dirname(torch.__file__)); print(torch.__version__); print(torch.version.cuda or ''); print(int(torch._C._GLIBCXX_USE_CXX11_ABI))"
  OUTPUT_VARIABLE _zs_torch_info OUTPUT_STRIP_TRAILING_WHITESPACE RESULT_VARIABLE _zs_torch_rc)
if(NOT _zs_torch_rc EQUAL 0)
  message(FATAL_ERROR "zeroshard: ${Python3_EXECUTABLE} cannot import torch. "
                      "Install it first: pip install -c constraints.txt torch")
endif()
string(REPLACE "\n" ";" _zs_torch_info "${_zs_torch_info}")
list(GET _zs_torch_info 0 ZEROSHARD_TORCH_CMAKE_PREFIX)
list(GET _zs_torch_info 1 ZEROSHARD_TORCH_DIR)
list(GET _zs_torch_info 2 ZEROSHARD_TORCH_VERSION)
list(LENGTH _zs_torch_info _zs_len)
set(ZEROSHARD_TORCH_CUDA "")
if(_zs_len GREATER 4)
  list(GET _zs_torch_info 3 ZEROSHARD_TORCH_CUDA)
  list(GET _zs_torch_info 4 ZEROSHARD_TORCH_CXX11_ABI)
else()
  list(GET _zs_torch_info 3 ZEROSHARD_TORCH_CXX11_ABI)
endif()
message(STATUS "zeroshard: torch ${ZEROSHARD_TORCH_VERSION} at ${ZEROSHARD_TORCH_DIR} (CUDA '${ZEROSHARD_TORCH_CUDA}')")

# Torch's own CMake config wants a matching CUDA toolkit, cuDNN and more just to hand back library
# paths; we only need its headers and libraries, so the targets are spelled out here instead.
set(_zs_inc "${ZEROSHARD_TORCH_DIR}/include")
set(_zs_lib "${ZEROSHARD_TORCH_DIR}/lib")
foreach(_l c10 torch_cpu torch torch_python)
  find_library(ZEROSHARD_LIB_${_l} NAMES ${_l} PATHS "${_zs_lib}" NO_DEFAULT_PATH REQUIRED)
endforeach()

add_library(zeroshard_aten INTERFACE)
add_library(zeroshard::aten ALIAS zeroshard_aten)
target_include_directories(zeroshard_aten SYSTEM INTERFACE "${_zs_inc}" "${_zs_inc}/torch/csrc/api/include")
target_link_libraries(zeroshard_aten INTERFACE ${ZEROSHARD_LIB_c10} ${ZEROSHARD_LIB_torch_cpu})
target_compile_definitions(zeroshard_aten INTERFACE
  _GLIBCXX_USE_CXX11_ABI=${ZEROSHARD_TORCH_CXX11_ABI} USE_C10D_GLOO USE_DISTRIBUTED)
# Loaders find libtorch's own dependencies next to it.
set(CMAKE_BUILD_RPATH "${_zs_lib}")
set(CMAKE_INSTALL_RPATH "${_zs_lib}")

add_library(zeroshard_torch_python INTERFACE)
add_library(zeroshard::torch_python ALIAS zeroshard_torch_python)
target_link_libraries(zeroshard_torch_python INTERFACE zeroshard_aten ${ZEROSHARD_LIB_torch} ${ZEROSHARD_LIB_torch_python})
# torch's bundled pybind11 (include/pybind11) is the one whose type casters carry tensors and
# process groups across the seam, so no other pybind11 is used.
target_compile_definitions(zeroshard_torch_python INTERFACE TORCH_EXTENSION_NAME=_C TORCH_API_INCLUDE_EXTENSION_H)

# The extension shares std::string, exceptions and iostreams with libtorch, so it must link the
# shared libstdc++ libtorch uses. A g++ that finds only libstdc++.a (a wrapper whose -B folder holds
# the archive but not the .so, as /opt/gcc/bin/g++ on the GPU machine does) copies a second
# libstdc++ into _C, which then segfaults at its first ostringstream.
if(CMAKE_CXX_COMPILER_ID STREQUAL "GNU")
  execute_process(COMMAND ${CMAKE_CXX_COMPILER} -print-file-name=libstdc++.so
                  OUTPUT_VARIABLE _zs_stdcxx OUTPUT_STRIP_TRAILING_WHITESPACE)
  if(NOT IS_ABSOLUTE "${_zs_stdcxx}")
    message(FATAL_ERROR "zeroshard: ${CMAKE_CXX_COMPILER} finds no shared libstdc++ "
            "(-print-file-name=libstdc++.so prints '${_zs_stdcxx}'), so the extension would carry its own "
            "static copy beside libtorch's shared one and crash. Build with a g++ that links the shared "
            "one, e.g. CXX=/usr/bin/g++ CUDAHOSTCXX=/usr/bin/g++ make build (and rm -rf build first).")
  endif()
endif()
