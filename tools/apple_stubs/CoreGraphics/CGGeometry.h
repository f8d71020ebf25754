// Stub (declarations only) for a Linux syntax check; see ../README.md.
#pragma once
typedef double CGFloat;
struct CGSize { CGFloat width; CGFloat height; };
struct CGPoint { CGFloat x; CGFloat y; };
struct CGRect { CGPoint origin; CGSize size; };
