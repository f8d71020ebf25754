// Stub (declarations only) for a Linux syntax check; see ../README.md.
#pragma once
#include <cstdint>
#include <math.h> // the SDK's CoreFoundation.h pulls in math.h (INFINITY in metal-cpp)
typedef double CFTimeInterval;
typedef const void* CFTypeRef;
typedef long CFIndex;
typedef unsigned long CFOptionFlags;
typedef unsigned long CFHashCode;
typedef uint32_t UInt32;
typedef const struct __CFString* CFStringRef;
typedef const struct __CFAllocator* CFAllocatorRef;
typedef struct CFRange { CFIndex location; CFIndex length; } CFRange;
typedef uint32_t CFStringEncoding;
extern "C" {
CFTypeRef CFRetain(CFTypeRef cf);
void CFRelease(CFTypeRef cf);
CFHashCode CFHash(CFTypeRef cf);
}
