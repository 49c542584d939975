#pragma once
// The torch-free storage side of the checkpointer, one unit per concern:
//   checksums.h          XXH3 of bytes in memory, FileDigest (whole file and chunks)
//   file_io.h            durable writes, bounded and parallel reads, directories held open
//   file_checksums.h     checksums of files on disk: whole file, chunks on several threads, page-cache residency
//   safetensors.h        the safetensors header codec (dtypes: ettkit/checkpoint/safetensors_dtypes.h)
//   manifest.h           the manifest codec and the JSON form of a FileDigest
//   identifiers.h        run ids, step numbers and file names that cross the Store or a file, checked
//   directory_layout.h   CKPT_DIR's layout, commit order, commit rename and retention
//   step_files.h         one rank's files of a committed step, opened together and checked
//   directory_lock.h     the writer's lock on CKPT_DIR
// This header includes them all, for the units and tests that use most of them.

#include "checkpoint/checksums.h"
#include "checkpoint/directory_layout.h"
#include "checkpoint/directory_lock.h"
#include "checkpoint/file_checksums.h"
#include "checkpoint/file_io.h"
#include "checkpoint/identifiers.h"
#include "checkpoint/manifest.h"
#include "checkpoint/safetensors.h"
#include "checkpoint/step_files.h"
