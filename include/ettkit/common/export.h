#pragma once
// Symbol visibility for libettkit.so: the library is built with hidden visibility, and only declarations
// marked ETTKIT_API are exported (and thereby part of the ABI a C++ consumer links against).
#if defined(_WIN32)
#define ETTKIT_API __declspec(dllexport)
#else
#define ETTKIT_API __attribute__((visibility("default")))
#endif
