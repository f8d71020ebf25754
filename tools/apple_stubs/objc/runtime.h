// Stub (declarations only) for a Linux syntax check; see ../README.md.
#pragma once
#include <cstddef>
#include <cstdint>
typedef struct objc_class* Class;
typedef struct objc_object { Class isa; }* id;
typedef struct objc_selector* SEL;
typedef id (*IMP)(id, SEL, ...);
typedef signed char BOOL;
typedef struct objc_object Protocol;
#ifndef YES
#define YES ((BOOL)1)
#define NO ((BOOL)0)
#endif
#ifndef nil
#define nil nullptr
#endif
extern "C" {
id objc_lookUpClass(const char* name);
Protocol* objc_getProtocol(const char* name);
SEL sel_registerName(const char* str);
bool class_addMethod(Class cls, SEL name, IMP imp, const char* types);
}
