// Stub (declarations only) for a Linux syntax check; see ../README.md.
#pragma once
#include "runtime.h"
extern "C" {
void objc_msgSend(void);
void objc_msgSend_fpret(void);
void objc_msgSend_stret(void);
}
