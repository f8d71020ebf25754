// Stub (declarations only) for a Linux syntax check; see ../README.md.
#pragma once
typedef struct CGColorSpace* CGColorSpaceRef;
